"""Agent loops on a model with recurrent layers: does every turn compute only what is new?

    python -m bench.bench_recurrent_agents [--quick] [--kinds qwen3_5,lfm2,granite_hybrid] [--agents 8 --turns 6]
                                           [--json recurrent_agents.json] [--plot recurrent_agents.png]

A tiny random-weight Qwen3.5 (Gated DeltaNet beside gated attention; LFM2 or Granite 4.0-H's Mamba2
with --kinds) with the default model's tokenizer and chat template, in process. 8 agents x 6 turns
share a tool prompt of 2k tokens; each turn re-renders every agent's whole conversation as messages (earlier replies'
ids spliced back, as --reply-token-reuse does) and all agents answer at once, greedily
(bench/lib/recurrent_agents.py). Run with the prefix cache on (its recurrent-state snapshots:
core/recurrent_snapshots.py) and off.

Reported, from turn 2 on: prompt tokens computed beyond the new ones (the ideal: whole blocks of
the longest prefix any earlier request computed; target <= 2% of the prompt tokens, i.e. >= 98%
of the ideal reuse), the recurrent-state memory (request slots and snapshots), the prompt tokens
computed and the wall with the cache on and off, and whether both runs gave the same tokens.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench.lib.cli import bench_parser, apply_quick, write_json
from bench.lib.recurrent_agents import FULL, QUICK, build_tiny_model, run_loops
from bench.lib.report import plot_bars, print_header

BLOCK_SIZE = 16
TARGET_BEYOND = 0.02


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick=f"{QUICK.describe()} (about half a minute)")
    parser.add_argument("--kinds", default="qwen3_5", help="tiny models to run: qwen3_5, lfm2, granite_hybrid (comma-separated)")
    parser.add_argument("--agents", type=int, default=FULL.agents)
    parser.add_argument("--turns", type=int, default=FULL.turns)
    parser.add_argument("--tool-prompt", type=int, default=FULL.tool_prompt, help="shared tool prompt, tokens")
    parser.add_argument("--answer", type=int, default=FULL.answer, help="tokens per reply")
    parser.add_argument("--kv-blocks", type=int, default=4096, help="KV blocks (snapshots: one per 8)")
    args = parser.parse_args(argv)
    apply_quick(parser, args, agents=QUICK.agents, turns=QUICK.turns, tool_prompt=QUICK.tool_prompt,
                answer=QUICK.answer)
    base = QUICK if args.quick else FULL
    workload = replace(base, agents=args.agents, turns=args.turns, tool_prompt=args.tool_prompt, answer=args.answer)
    print_header("agent loops on recurrent models: tokens computed beyond the new ones",
                 [workload.describe(), f"blocks of {BLOCK_SIZE} tokens, {args.kv_blocks} KV blocks; "
                  f"target: beyond the new ones <= {TARGET_BEYOND:.0%} of the prompt tokens, from turn 2 on"])
    figures, met = {}, True
    for kind in args.kinds.split(","):
        figures[kind] = run_kind(kind.strip(), workload, args.kv_blocks)
        met = met and figures[kind]["beyond_share"] <= TARGET_BEYOND and figures[kind]["same_tokens"]
    if args.json:
        write_json(args.json, figures, args)
    if args.plot:
        groups = [f"{k} turn {t + 1}" for k in figures for t in range(workload.turns)]
        series = {"computed, cache on": [v for k in figures for v in figures[k]["computed_by_turn_on"]],
                  "computed, cache off": [v for k in figures for v in figures[k]["computed_by_turn_off"]],
                  "new tokens": [v for k in figures for v in figures[k]["new_by_turn"]]}
        plot_bars(args.plot, "prompt tokens computed per turn", groups, series, "tokens")
    return 0 if met else 1


def run_kind(kind: str, workload, kv_blocks: int) -> dict:
    from radixserve import Engine
    from radixserve.model.default_model import ensure_default_model

    with tempfile.TemporaryDirectory() as tmp:
        directory = build_tiny_model(kind, Path(tmp) / kind, ensure_default_model())
        runs = {}
        for cache in (True, False):
            engine = Engine(str(directory), block_size=BLOCK_SIZE, num_kv_blocks=kv_blocks,
                            enable_prefix_cache=cache, max_num_seqs=max(8, workload.agents))
            print(f"\n{kind}, prefix cache {'on' if cache else 'off'}:")
            start = time.perf_counter()
            records = run_loops(engine, workload, BLOCK_SIZE)
            runs[cache] = (records, time.perf_counter() - start, engine.stats())
            engine.check_integrity()
            engine.close()
    return report(kind, workload, runs)


def report(kind: str, workload, runs: dict) -> dict:
    (on, wall_on, stats), (off, wall_off, stats_off) = runs[True], runs[False]
    later = [r for r in on if r.turn > 0]
    prompt = sum(r.prompt_tokens for r in later)
    ideal = sum(r.ideal_tokens for r in later)
    cached = sum(r.cached_tokens for r in later)
    beyond = ideal - cached
    by_turn = lambda records, f: [sum(f(r) for r in records if r.turn == t) for t in range(workload.turns)]
    computed_on = by_turn(on, lambda r: r.prompt_tokens - r.cached_tokens)
    computed_off = by_turn(off, lambda r: r.prompt_tokens - r.cached_tokens)
    new = by_turn(on, lambda r: r.prompt_tokens - r.ideal_tokens)
    same = [r.output for r in on] == [r.output for r in off]
    print(f"\n{kind}: per turn (all agents)   " + "  ".join(f"turn {t + 1}" for t in range(workload.turns)))
    for name, values in (("new tokens", new), ("computed, cache on", computed_on), ("computed, cache off", computed_off)):
        print(f"  {name:<26}" + "".join(f"{v:>8}" for v in values))
    share = beyond / prompt if prompt else 0.0
    verdict = "meets target" if share <= TARGET_BEYOND else "BELOW target"
    print(f"  from turn 2 on: {prompt} prompt tokens, ideal reuse {ideal}, cached {cached} "
          f"({cached / ideal:.1%} of ideal); computed beyond the new ones {beyond} = {share:.2%} of the prompt "
          f"tokens (target <= {TARGET_BEYOND:.0%}) [{verdict}]")
    print(f"  recurrent-state memory: {stats['recurrent_state_bytes'] / 2**20:.2f} MiB allocated "
          f"(one request's states {stats['recurrent_request_bytes']} B; {stats['recurrent_snapshots_kept']} snapshots "
          f"kept of room for {stats['recurrent_snapshots_total']}, {stats['recurrent_snapshot_saves']} saved, "
          f"{stats['recurrent_snapshot_restores']} restored, {stats['recurrent_snapshots_evicted']} evicted)")
    print(f"  prompt tokens computed, all turns: cache on {sum(computed_on)}, off {sum(computed_off)} "
          f"({sum(computed_off) / max(1, sum(computed_on)):.1f}x); wall: on {wall_on:.1f} s, off {wall_off:.1f} s "
          f"({wall_off / wall_on:.2f}x); same tokens on and off: {same}")
    return dict(prompt_tokens=prompt, ideal_tokens=ideal, cached_tokens=cached, beyond_tokens=beyond,
                beyond_share=share, of_ideal=cached / ideal if ideal else 1.0, wall_on_s=wall_on, wall_off_s=wall_off,
                computed_by_turn_on=computed_on, computed_by_turn_off=computed_off, new_by_turn=new, same_tokens=same,
                recurrent={k: v for k, v in stats.items() if k.startswith("recurrent")},
                records=[asdict(r) for r in on])


if __name__ == "__main__":
    sys.exit(main())
