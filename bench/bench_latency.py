"""Latency under load: TTFT, inter-token gap and end-to-end p50/p95 with and without the step budget.

    .venv/bin/python -m bench.bench_latency --quick            # no-sharing only, 16 prompts, one run each
    .venv/bin/python -m bench.bench_latency --repeats 3 --plot latency.png
    .venv/bin/python -m bench.bench_latency --configs "" "--max-step-ms 120" "--max-step-ms 80"
    .venv/bin/python -m bench.bench_latency --llama-server ~/llama.cpp/build/bin/llama-server \
        --llama-model smollm2-135m-f32.gguf                   # plus the llama.cpp server, side by side

Two (or more) `radixserve serve` processes, one per configuration, run side by side and take turns:
each run sends a workload's prompts (token ids) to one server as streaming /v1/completions with
Poisson arrivals (--rate, default 0.8 req/s), greedy with ignore_eos, and records when each chunk
of text arrives. Workloads (bench/lib/workloads.py): no-sharing (32 prompts of 64-512 tokens, 32-128
new), shared-prefix (4 groups x 8 prompts on a 512-token system prompt, 32 new) and long-context
(8 unrelated 3,000-token prompts, 64 new each; give llama.cpp 4k of context a slot:
`--llama-args "-np 8 -c 32768 -t 2"`). Reports, per
configuration and workload, the median over runs of each percentile and its spread (min-max),
then the ratios of every configuration to the first. With --llama-server, a llama.cpp server
(`llama-server -m --llama-model`, --llama-args: 8 slots, 2 threads by default) takes its turn too,
under the label "llama.cpp", with the same requests (its /v1/completions takes token ids). Every
server's cache is emptied before each run (llama.cpp: its slots erased, its RAM prompt cache off):
the runs repeat the same prompts, and a cache kept from the run before would answer them.

With --trace DIR every radixserve server also writes its step trace there (`--step-trace`: each
step's end, ms, decode and prompt tokens, on the clock the client uses), and the report adds,
per run, the anatomy of the gap tail: how many gaps exceed the 120 ms target, how many of those
overlap a step that carried prompt tokens, and the step times with and without prompt tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

from bench.lib import workloads
from bench.lib.client import Record, arrivals, complete
from bench.lib.servers import served
from bench.lib.cli import apply_quick, bench_parser, write_json
from bench.lib.harness import percentile
from bench.lib.peers import add_llama_server

TARGETS = {"gap_p95_ms": 120.0, "ttft_p95_s": 1.5}


@dataclass
class RunResult:
    config: str
    workload: str
    streams: list[Record]
    start: float  # time.monotonic()
    duration_s: float

    def summary(self) -> dict[str, float]:
        ok = [s for s in self.streams if s.error is None and s.chunks]
        ttft = [s.chunks[0] - s.sent for s in ok]
        gaps = [b - a for s in ok for a, b in zip(s.chunks, s.chunks[1:])]
        e2e = [s.end - s.sent for s in ok]
        return {
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "gap_p50_ms": percentile(gaps, 50) * 1000, "gap_p95_ms": percentile(gaps, 95) * 1000,
            "e2e_p50_s": percentile(e2e, 50), "e2e_p95_s": percentile(e2e, 95),
            "output_tok_s": sum(s.completion_tokens for s in ok) / self.duration_s,
            "failed": float(len(self.streams) - len(ok)),
        }


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    labels = [config or "(defaults)" for config in args.configs]
    if len(set(labels)) != len(labels):
        raise SystemExit("--configs: every configuration once")
    traces = {label: os.path.join(args.trace, f"steps-{i}.jsonl") if args.trace else None
              for i, label in enumerate(labels)}
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        for path in traces.values():
            open(path, "w").close()
    with contextlib.ExitStack() as stack:
        systems = [(label, stack.enter_context(_server(args, config, traces[label])))
                   for label, config in zip(labels, args.configs)]
        if args.llama_server:
            systems.append(("llama.cpp", stack.enter_context(_llama_server(args))))
        results = asyncio.run(_run_all(systems, args))
    _report(args, [label for label, _ in systems], results)
    if args.trace:
        _report_anatomy(results, {label: _read_trace(path) for label, path in traces.items()})
    if args.plot:
        _plot(args.plot, args, [label for label, _ in systems], results)
        print(f"\nplot written to {args.plot}")
    if args.json:
        write_json(args.json, [{"config": r.config, "workload": r.workload, **r.summary()} for r in results], args)
    return 0


def _workload(name: str, args: argparse.Namespace) -> list[tuple[list[int], int]]:
    if name == "no-sharing":
        w = workloads.no_sharing(num_prompts=args.prompts)
    elif name == "long-context":
        w = workloads.long_context()
    else:
        w = workloads.shared_prefix(groups=4, prompts_per_group=max(1, args.prompts // 4))
    return [(s.turns[0].new_tokens, s.turns[0].max_tokens) for s in w.sessions]  # single-turn sessions


async def _run_all(systems: list[tuple[str, str]], args: argparse.Namespace) -> list[RunResult]:
    results = []
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        for _, url in systems:  # one untimed warm-up request each
            await complete(client, "m", [1, 2, 3, 4], 4, "warm-up", url)
        for repeat in range(args.repeats):
            for name in args.workloads:
                for label, url in systems:
                    await _flush(client, label, url)
                    print(f"run {repeat + 1}/{args.repeats}: {name} on {label}", file=sys.stderr)
                    results.append(await _one_run(client, url, label, name, args, seed=repeat))
    return results


async def _flush(client: httpx.AsyncClient, label: str, url: str) -> None:
    """Empty the server's prefix cache so that no run reuses an earlier run's prompts (the
    workload's prompts are the same every run). llama.cpp: erase every slot's KV (its RAM
    prompt cache is off, -cram 0)."""
    if label != "llama.cpp":
        (await client.post(url + "/flush_cache")).raise_for_status()
        return
    slots = (await client.get(url + "/props")).json()["total_slots"]
    for i in range(slots):
        (await client.post(url + f"/slots/{i}?action=erase")).raise_for_status()


async def _one_run(client, url, label, name, args, seed: int) -> RunResult:
    items = _workload(name, args)
    delays = arrivals(random.Random(100 + seed), args.rate, len(items))
    start = time.monotonic()

    async def one(delay, prompt, max_tokens):
        await asyncio.sleep(delay)
        return await complete(client, "m", prompt, max_tokens, label, url)

    streams = await asyncio.gather(*(one(d, p, m) for d, (p, m) in zip(delays, items)))
    return RunResult(label, name, list(streams), start, time.monotonic() - start)


def _server(args: argparse.Namespace, extra: str, trace: str | None):
    command = [sys.executable, "-m", "radixserve", "serve", "--log-level", "warning",
               "--served-model-name", "m"] + shlex.split(args.server_args) + shlex.split(extra)
    if trace:
        command += ["--step-trace", trace]
    return served(command, env=_env(), stdout=subprocess.DEVNULL)


@contextlib.contextmanager
def _llama_server(args: argparse.Namespace):
    if not args.llama_model:
        raise SystemExit("--llama-server needs --llama-model (a GGUF file)")
    with tempfile.TemporaryDirectory(prefix="llama-slots-") as slot_dir:  # erasing slots (see _flush) needs one
        command = [args.llama_server, "-m", args.llama_model, "--host", "127.0.0.1", "--alias", "m",
                   "--slot-save-path", slot_dir, "-cram", "0"]
        with served(command + shlex.split(args.llama_args), env=_env(), stdout=subprocess.DEVNULL) as url:
            yield url


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "RADIXSERVE_API_KEY"}


def _report(args: argparse.Namespace, labels: list[str], results: list[RunResult]) -> None:
    print(f"\nlatency under load: Poisson {args.rate} req/s, streaming /v1/completions, greedy, ignore_eos; "
          f"{args.repeats} run(s) per configuration, configurations taking turns; median [min-max] over runs")
    keys = ["ttft_p50_s", "ttft_p95_s", "gap_p50_ms", "gap_p95_ms", "e2e_p50_s", "e2e_p95_s", "output_tok_s"]
    table: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in results:
        entry = table.setdefault((r.workload, r.config), {k: [] for k in keys + ["failed"]})
        for k, v in r.summary().items():
            entry[k].append(v)
    for name in args.workloads:
        print(f"\n== {name}")
        configs = labels
        for config in configs:
            entry = table[(name, config)]
            cells = [f"{k} {_median(entry[k]):.3g} [{min(entry[k]):.3g}-{max(entry[k]):.3g}]" for k in keys]
            print(f"  {config}: " + ", ".join(cells) + f"; failed {int(sum(entry['failed']))}")
            misses = [f"{k} {_median(entry[k]):.3g} > {t}" for k, t in TARGETS.items() if _median(entry[k]) > t]
            if name == "no-sharing":
                print(f"    targets (gap p95 <= 120 ms, TTFT p95 <= 1.5 s): {'met' if not misses else 'NOT met: ' + ', '.join(misses)}")
        base = table[(name, configs[0])]
        for config in configs[1:]:
            entry = table[(name, config)]
            ratios = [f"{k} {_median(entry[k]) / _median(base[k]):.2f}x" for k in keys]
            print(f"  {config} / {configs[0]}: " + ", ".join(ratios))


def _read_trace(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _report_anatomy(results: list[RunResult], traces: dict[str, list[dict]]) -> None:
    print(f"\ntail anatomy (--trace): gaps over {TARGETS['gap_p95_ms']:.0f} ms and the steps they overlap; "
          "step ms p50 / p95 of steps that carried decodes, without and with prompt tokens")
    for r in results:
        a = tail_anatomy(r, traces.get(r.config, []), TARGETS["gap_p95_ms"] / 1000)
        if a is None:
            continue
        print(f"  {r.workload} on {r.config}: {a['long']} of {a['gaps']} gaps over the target, {a['with_prompt']} of "
              f"them overlapping a step with prompt tokens; {a['steps']} steps: decodes only "
              f"{percentile(a['plain_ms'], 50):.0f} / {percentile(a['plain_ms'], 95):.0f} ms ({len(a['plain_ms'])}), decodes + "
              f"prompt {percentile(a['mixed_ms'], 50):.0f} / {percentile(a['mixed_ms'], 95):.0f} ms ({len(a['mixed_ms'])})")


def tail_anatomy(run: RunResult, steps: list[dict], limit_s: float) -> dict | None:
    """One run's gaps longer than limit_s, how many of them overlap a step that carried prompt
    tokens, and the times of the steps that carried decodes (without / with prompt tokens);
    None when the trace holds no step of the run."""
    steps = [s for s in steps if run.start <= s["end"] <= run.start + run.duration_s]
    if not steps:
        return None
    spans = [(s["end"] - s["ms"] / 1000, s["end"], s["prefill"]) for s in steps]
    gaps = [(a, b) for st in run.streams if st.error is None for a, b in zip(st.chunks, st.chunks[1:])]
    long = [(a, b) for a, b in gaps if b - a > limit_s]
    return {
        "gaps": len(gaps),
        "long": len(long),
        "with_prompt": sum(any(lo < b and hi > a and prefill for lo, hi, prefill in spans) for a, b in long),
        "steps": len(steps),
        "plain_ms": [s["ms"] for s in steps if s["decode"] and not s["prefill"]],
        "mixed_ms": [s["ms"] for s in steps if s["decode"] and s["prefill"]],
    }


def _median(values: list[float]) -> float:
    return percentile(values, 50)


def _plot(path: str, args: argparse.Namespace, labels: list[str], results: list[RunResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.workloads), figsize=(6 * len(args.workloads), 4), squeeze=False)
    for ax, name in zip(axes[0], args.workloads):
        data = [[(b - a) * 1000 for r in results if r.workload == name and r.config == label
                 for s in r.streams for a, b in zip(s.chunks, s.chunks[1:])] for label in labels]
        ax.boxplot(data, tick_labels=labels, whis=(5, 95), showfliers=False)
        ax.set_title(f"{name}: inter-token gap (5-95%)")
        ax.set_ylabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_quick(parser, args, workloads=["no-sharing"], prompts=16, repeats=1)
    return args


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser(__doc__, quick="no-sharing only, 16 prompts, one run each",
                     plot="write a PNG of the gap distributions here", json_help="write every run's summary here")
    p.add_argument("--configs", nargs="+", default=["--max-step-ms 0", "--max-step-ms 120"],
                   help="server flags of each configuration (the first is the baseline of the ratios)")
    p.add_argument("--server-args", default="", help="flags for every server")
    p.add_argument("--workloads", nargs="+", default=["no-sharing", "shared-prefix"],
                   choices=["no-sharing", "shared-prefix", "long-context"])
    p.add_argument("--rate", type=float, default=0.8)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--trace", help="a directory for the servers' step traces: adds the gap tail's anatomy")
    add_llama_server(p, help="llama.cpp's llama-server binary (default: $LLAMA_SERVER): run it side by side too")
    p.add_argument("--llama-model", help="the GGUF file the llama.cpp server loads")
    p.add_argument("--llama-args", default="-np 8 -c 8192 -t 2", help="its flags (slots, context, threads)")
    return p


if __name__ == "__main__":
    sys.exit(main())
