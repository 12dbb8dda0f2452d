"""Decode speed of a mixture-of-experts model: radixserve against llama.cpp's server on the same
random-weight GGUF of a released layer shape (bench/lib/moe_gguf.py; output quality does not
matter for speed), the same requests to each server in turn. Both servers run for the whole
bench, one of them idle while the other serves, and the runs alternate between them (a run of
one, then the same run of the other): this machine's pace moves by up to 1.6x between minutes,
and a server measured only in the minutes after the other's would carry that drift as a ratio.

    .venv/bin/python -m bench.bench_moe --llama-server PATH     # or $LLAMA_SERVER
    .venv/bin/python -m bench.bench_moe --quick                  # fewer new tokens and repetitions

  decode b1, decode b8: generated tokens per second of 1 and 8 concurrent streams (16-token random
  prompts, --new-tokens each, EOS ignored), from the requests' sending to the last one's end (the
  16-token prefill included: llama.cpp's server holds back text that is not yet whole UTF-8, which
  this random vocabulary's tokens often are, so its streams' first-token times are not usable),
  the median of --reps runs after a warm-up run of each; the ratio is that of the medians.
  Targets (issue 60): radixserve >= 1.0x llama.cpp at batch 1, >= 1.5x at batch 8.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics

import httpx

from bench.lib.cli import Figures, apply_quick, bench_parser
from bench.lib.client import complete
from bench.lib.moe_gguf import SHAPES, random_moe_gguf
from bench.lib.peers import add_llama_server
from bench.lib.servers import radixserve_command, serving
from radixserve.config import cache_root

WORKLOADS = ("decode b1", "decode b8")
TARGETS = {"decode b1": 1.0, "decode b8": 1.5}
SLOTS, CONTEXT = 8, 8192


def main() -> None:
    parser = bench_parser(__doc__, quick="32 new tokens, 2 repetitions")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b-3l")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's -t and -tb")
    add_llama_server(parser)
    args = parser.parse_args()
    apply_quick(parser, args, new_tokens=32, reps=2)
    shape = SHAPES[args.shape]
    path = random_moe_gguf(shape, cache_root() / "bench" / f"{shape.name}.Q4_0.gguf")
    print(f"model: random-weight qwen3moe GGUF {path.name}: {shape.params() / 1e9:.2f}B parameters, "
          f"{shape.layers} layers of {shape.experts} experts (top {shape.top_k}), Q4_0", flush=True)
    systems = [("radixserve", radixserve_command("--model", str(path), "--max-model-len", str(CONTEXT)))]
    if args.llama_server:
        systems.append(("llama.cpp", [args.llama_server, "-m", str(path), "--host", "127.0.0.1", "-c",
                                      str(CONTEXT * SLOTS), "-np", str(SLOTS), "-t", str(args.threads),
                                      "-tb", str(args.threads), "-cram", "0", "--alias", "m"]))
    figures = Figures()
    rates: dict[str, dict[str, float]] = {}
    with contextlib.ExitStack() as stack:
        urls = {label: stack.enter_context(serving(command))[0] for label, command in systems}
        for workload in WORKLOADS:
            runs = asyncio.run(_alternate(urls, int(workload.split()[1][1:]), args))
            for label, rate in runs.items():
                rates.setdefault(workload, {})[label] = rate
                figures.add(workload, label, rate)
                print(f"  {label} {workload}: {rate:.1f} tokens/s", flush=True)
    print(f"decode tokens/s, median of {args.reps} runs of {args.new_tokens} new tokens:")
    for workload in WORKLOADS:
        row = rates[workload]
        line = "  " + f"{workload:<10}" + "".join(f"{label:>12} {rate:8.1f}" for label, rate in row.items())
        if "llama.cpp" in row:
            ratio = row["radixserve"] / row["llama.cpp"]
            met = "meets" if ratio >= TARGETS[workload] else "BELOW"
            line += f"   radixserve / llama.cpp {ratio:.2f}x (target >= {TARGETS[workload]}x) [{met} target]"
        print(line)
    figures.finish(args, "decode tokens/s", "tokens/s")


async def _alternate(urls: dict[str, str], batch: int, args) -> dict[str, float]:
    """Each server's median tokens/s over --reps runs of `batch` streams, the servers taking
    turns run by run (the same prompts for both within a run), after a warm-up run of each."""
    rates: dict[str, list[float]] = {label: [] for label in urls}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for rep in range(args.reps + 1):
            rng = random.Random(rep * 7919 + batch)
            prompts = [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(batch)]
            for label, url in urls.items():
                rate = await _run(client, url, prompts, args.new_tokens)
                if rep:
                    rates[label].append(rate)
            print(f"    b{batch} run {rep + 1}/{args.reps + 1}{' (warm-up)' if not rep else ''}: "
                  + ", ".join(f"{label} {r[-1]:.1f}" for label, r in rates.items() if rep), flush=True)
    return {label: statistics.median(r) for label, r in rates.items()}


async def _run(client: httpx.AsyncClient, url: str, prompts: list[list[int]], new_tokens: int) -> float:
    """Generated tokens per second of one run: every prompt at once, from the first request's
    sending to the last one's end."""
    records = await asyncio.gather(*(complete(client, "m", p, new_tokens, "decode", url) for p in prompts))
    if any(r.error or r.end is None for r in records):
        raise SystemExit(f"a request failed: {[r.error for r in records if r.error]}")
    generated = sum(r.completion_tokens for r in records)
    if generated != len(prompts) * new_tokens:
        raise SystemExit(f"{generated} tokens generated, {len(prompts) * new_tokens} asked for")
    return generated / (max(r.end for r in records) - min(r.sent for r in records))


if __name__ == "__main__":
    main()
