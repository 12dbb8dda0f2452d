"""Drafting replayed offline (issue 61): each agent trace's greedy outputs recorded once on the
default model (or read back from --records), then prompt lookup and suffix drafting run over
them without the model (bench/lib/draft_replay.py), batch 1, step times from a table.

    .venv/bin/python -m bench.bench_draft_replay --records /tmp/agent_outputs.json   # records once, then reads
    .venv/bin/python -m bench.bench_draft_replay --records R.json --step-ms 1:10,2:10.5,8:12,16:20   # rows nearly free

Methods: prompt lookup, suffix drafting (chains), suffix drafting's trees (two candidates a
node, bench/lib/draft_replay.py's TREE_WIDTH). Prints per trace and method: decode steps, tokens per step, drafts, the accepted length (tokens
a verification appends), the decode time's speedup over no drafts on the table, and suffix
against prompt lookup. Deterministic: a drafting change is judged without the machine's noise
(the engine's own bench, bench_speculative --workload agents, measures real time).
"""

from __future__ import annotations

import json
import os
import sys
import time

from bench.lib.agent_traces import TRACES, trace
from bench.lib.cli import Figures, apply_quick, bench_parser
from bench.lib.draft_replay import AVX2_STEP_MS, METHODS, record, replay


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    recorded = _recorded(args)
    step_ms = _table(args.step_ms)
    print(f"drafting replayed on recorded greedy outputs, batch 1; step ms by rows {step_ms}")
    figures, summary = Figures(), {}
    for name in args.traces:
        t0 = time.perf_counter()
        for method in METHODS:
            r = replay(recorded[name], method, step_ms)
            summary[(name, method)] = r
            figures.add(name, method, r.speedup, tokens_per_step=r.tokens_per_step, accepted_length=r.accepted_length,
                        steps=r.steps, drafts=r.drafts)
            print(f"   {name:10s} {method:14s} {r.steps:5d} steps, {r.tokens_per_step:.2f} tokens a step, "
                  f"{r.drafts} drafts, accepted length {r.accepted_length:.2f}, "
                  f"acceptance {r.accepted}/{r.draft_tokens}; {r.speedup:.2f}x no drafts")
        pl, sx, tr = (summary[(name, m)] for m in ("prompt-lookup", "suffix", "suffix-tree"))
        print(f"   {name}: suffix {sx.speedup / pl.speedup:.2f}x prompt lookup, suffix trees {tr.speedup / sx.speedup:.2f}x "
              f"suffix chains ({time.perf_counter() - t0:.1f} s)")
    figures.finish(args, "replayed drafting: speedup over no drafts on the step table", "x no drafts")
    return 0


def _recorded(args) -> dict[str, list]:
    """The traces' recorded outputs: read from --records, or recorded now (and written there)."""
    if args.records and os.path.exists(args.records):
        with open(args.records) as f:
            data = json.load(f)
        missing = [t for t in args.traces if t not in data]
        if not missing:
            print(f"recorded outputs read from {args.records}")
            return data
        print(f"{args.records} lacks {missing}: recording them")
    else:
        data = {}
    from radixserve import Engine

    engine = Engine(args.model)
    for name in args.traces:
        if name not in data:
            print(f"recording {name} ...", flush=True)
            prompts = [engine.apply_chat_template(m) for m in trace(name).requests]
            data[name] = record(engine, prompts, args.max_tokens)
    if args.records:
        with open(args.records, "w") as f:
            json.dump(data, f)
    return data


def _table(text: str | None) -> dict[int, float]:
    if not text:
        return dict(AVX2_STEP_MS)
    return {int(rows): float(ms) for rows, ms in (item.split(":") for item in text.split(","))}


def _parse_args(argv):
    p = bench_parser(__doc__, quick="tool loop and chat only")
    p.add_argument("--records", default=None, help="recorded outputs (JSON): read if there, else recorded and written")
    p.add_argument("--traces", nargs="+", choices=list(TRACES), default=list(TRACES))
    p.add_argument("--model", default=None)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--step-ms", default=None, help="rows:ms,... (default: the AVX2 dev machine's table)")
    args = p.parse_args(argv)
    apply_quick(p, args, traces=["tool_loop", "chat"])
    return args


if __name__ == "__main__":
    sys.exit(main())
