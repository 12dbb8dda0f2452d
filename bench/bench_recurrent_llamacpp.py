"""Agent loops on a recurrent hybrid of a real shape: radixserve against llama.cpp's server on the
same random-weight GGUF (Q4_0; output quality does not matter for speed), the same requests to
each server in turn. Shapes: LFM2-350M (bench/lib/lfm2_gguf.py: short convolutions) and
Qwen3.5-0.8B (bench/lib/qwen35_gguf.py: Gated DeltaNet beside gated attention).

    .venv/bin/python -m bench.bench_recurrent_llamacpp --llama-server PATH    # or $LLAMA_SERVER
    .venv/bin/python -m bench.bench_recurrent_llamacpp --shape qwen3.5-0.8b
    .venv/bin/python -m bench.bench_recurrent_llamacpp --quick               # 4 agents x 3 turns, 512-token tool prompt

8 agents x 6 turns share a tool prompt of 2,048 tokens; each has its own task (40 tokens); every
turn each agent's whole history is sent again as token ids (the random vocabulary needs no chat
template), all agents of a turn at once, and each answers 32 tokens greedily (EOS ignored). The
history grows by the reply and a 60-token tool result; a reply is re-sent as fixed ids of its
length (this random vocabulary's text does not round-trip, and the servers' ids are not returned),
the same for both servers, so a cache can reuse a turn's prompt up to its end, not its reply.
Reported: each server's wall for the whole loop, the ratio (issue 60's target: radixserve <= 0.5x
llama.cpp's wall) and the prompt tokens each computed (prompt tokens less those it reported cached).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx

from bench.lib.cli import Figures, apply_quick, bench_parser
from bench.lib.lfm2_gguf import SHAPES as LFM2_SHAPES
from bench.lib.lfm2_gguf import random_lfm2_gguf
from bench.lib.qwen35_gguf import SHAPES as QWEN35_SHAPES
from bench.lib.qwen35_gguf import random_qwen35_gguf
from bench.lib.peers import add_llama_server
from bench.lib.servers import radixserve_command, serving
from radixserve.config import cache_root

TARGET = 0.5  # radixserve's wall / llama.cpp's
SHAPES = {**LFM2_SHAPES, **QWEN35_SHAPES}
WRITERS = {**{name: random_lfm2_gguf for name in LFM2_SHAPES}, **{name: random_qwen35_gguf for name in QWEN35_SHAPES}}


@dataclass
class LoopResult:
    wall_s: float
    prompt_tokens: int
    computed_tokens: int  # prompt tokens the server did not report cached
    computed_by_turn: list[int]


def main() -> None:
    parser = bench_parser(__doc__, quick="4 agents x 3 turns, a 512-token tool prompt, 16-token replies")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="lfm2-350m")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tool-prompt", type=int, default=2048, help="shared tool prompt, tokens")
    parser.add_argument("--task", type=int, default=40, help="each agent's task, tokens")
    parser.add_argument("--tool-result", type=int, default=60, help="tokens a tool result adds each turn")
    parser.add_argument("--answer", type=int, default=32, help="tokens per reply")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's -t and -tb")
    add_llama_server(parser)
    args = parser.parse_args()
    apply_quick(parser, args, agents=4, turns=3, tool_prompt=512, answer=16)
    shape = SHAPES[args.shape]
    path = WRITERS[args.shape](shape, cache_root() / "bench" / f"{shape.name}.Q4_0.gguf")
    longest = args.tool_prompt + args.task + args.turns * (args.answer + args.tool_result) + 64
    context = 1 << (longest - 1).bit_length()
    arch, recurrent = getattr(shape, "arch", "lfm2"), getattr(shape, "recurrent", "short convolutions")
    print(f"model: random-weight {arch} GGUF {path.name}: {shape.params() / 1e6:.0f}M parameters, {shape.layers} "
          f"layers ({len(shape.attention)} attention, the others {recurrent}), Q4_0", flush=True)
    print(f"workload: {args.agents} agents x {args.turns} turns; shared tool prompt {args.tool_prompt} tokens, task "
          f"{args.task}, tool result {args.tool_result}, reply {args.answer}; every turn the whole history re-sent "
          f"as token ids, all agents at once", flush=True)
    systems = [("radixserve", radixserve_command("--model", str(path), "--max-model-len", str(context),
                                                 "--max-num-seqs", str(max(8, args.agents))))]
    if args.llama_server:
        systems.append(("llama.cpp", [args.llama_server, "-m", str(path), "--host", "127.0.0.1", "-c",
                                      str(context * args.agents), "-np", str(args.agents), "-t", str(args.threads),
                                      "-tb", str(args.threads), "--alias", "m"]))
    else:
        print("llama.cpp left out: give --llama-server or set LLAMA_SERVER", flush=True)
    results: dict[str, LoopResult] = {}
    figures = Figures()
    for label, command in systems:
        with serving(command) as (url, _process):
            print(f"{label}:", flush=True)
            results[label] = asyncio.run(_loop(url, args, shape.vocab))
        r = results[label]
        figures.add("agent loop wall", label, r.wall_s, prompt_tokens=r.prompt_tokens,
                    computed_tokens=r.computed_tokens, computed_by_turn=r.computed_by_turn)
        print(f"  {label}: wall {r.wall_s:.1f} s; {r.prompt_tokens} prompt tokens sent, {r.computed_tokens} computed "
              f"(per turn {r.computed_by_turn})", flush=True)
    if "llama.cpp" in results:
        ratio = results["radixserve"].wall_s / results["llama.cpp"].wall_s
        met = "meets" if ratio <= TARGET else "BELOW"
        print(f"wall: radixserve {results['radixserve'].wall_s:.1f} s, llama.cpp {results['llama.cpp'].wall_s:.1f} s: "
              f"radixserve / llama.cpp {ratio:.2f}x (target <= {TARGET}x) [{met} target]; prompt tokens computed: "
              f"radixserve {results['radixserve'].computed_tokens}, llama.cpp {results['llama.cpp'].computed_tokens}")
    figures.finish(args, "agent loop wall (s)", "s")


def _histories(args, vocab: int) -> tuple[list[list[int]], random.Random]:
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(300, vocab) for _ in range(n)]  # noqa: E731 - past the byte symbols
    tools = ids(args.tool_prompt)
    return [tools + ids(args.task) for _ in range(args.agents)], rng


async def _loop(url: str, args, vocab: int) -> LoopResult:
    histories, rng = _histories(args, vocab)
    sent = computed = 0
    by_turn = []
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        start = time.perf_counter()
        for turn in range(args.turns):
            usages = await asyncio.gather(*(_complete(client, url, h, args.answer) for h in histories))
            turn_computed = sum(p - c for p, c in usages)
            sent += sum(p for p, _ in usages)
            computed += turn_computed
            by_turn.append(turn_computed)
            print(f"  turn {turn + 1}/{args.turns}: {sum(p for p, _ in usages)} prompt tokens, {turn_computed} "
                  f"computed, {time.perf_counter() - start:.1f} s", flush=True)
            for h in histories:  # the reply (as fixed ids of its length), then the tool's result
                h += [rng.randrange(300, vocab) for _ in range(args.answer + args.tool_result)]
        wall = time.perf_counter() - start
    return LoopResult(wall, sent, computed, by_turn)


async def _complete(client: httpx.AsyncClient, url: str, prompt: list[int], answer: int) -> tuple[int, int]:
    """One greedy completion of `answer` tokens: (prompt tokens, of them reported cached)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": answer, "temperature": 0.0, "ignore_eos": True}
    reply = await client.post(url + "/v1/completions", json=body)
    if reply.status_code != 200:
        raise SystemExit(f"a request failed: {reply.status_code} {reply.text[:300]}")
    usage = reply.json()["usage"]
    if usage["completion_tokens"] != answer or usage["prompt_tokens"] != len(prompt):
        raise SystemExit(f"asked {len(prompt)} + {answer} tokens, the server counted {usage}")
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


if __name__ == "__main__":
    main()
