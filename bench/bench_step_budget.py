"""The step budget inside the engine (no HTTP): Poisson arrivals of the no-sharing workload fed
to Engine.step directly; step times of steps that carry decodes, p50 / p95 / max, and the fitted
cost model, for each --max-step-ms given.

    .venv/bin/python -m bench.bench_step_budget --max-step-ms 0 120 --prompts 12
"""

from __future__ import annotations

import random
import sys
import time

from bench.lib import workloads
from bench.lib.cli import Figures, apply_quick, bench_parser
from bench.lib.harness import percentile
from radixserve import Engine, SamplingParams


def run(max_step_ms: int, prompts: int, rate: float) -> dict[str, float]:
    engine = Engine(max_step_ms=max_step_ms)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm-up
    w = workloads.no_sharing(num_prompts=prompts)
    items = [(s.turns[0].new_tokens, s.turns[0].max_tokens) for s in w.sessions]
    rng, t, arrivals = random.Random(100), 0.0, []
    for _ in items:
        arrivals.append(t)
        t += rng.expovariate(rate)
    start, i, steps = time.monotonic(), 0, []
    while i < len(items) or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while i < len(items) and arrivals[i] <= now:
            engine.add_request(items[i][0], SamplingParams(max_tokens=items[i][1], temperature=0.0, ignore_eos=True))
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(0.01)
            continue
        t0 = time.perf_counter()
        engine.step()
        steps.append(((time.perf_counter() - t0) * 1000, engine.last_step_tokens))
    with_decodes = [ms for ms, (decode_tokens, _) in steps if decode_tokens]
    gaps = [ms for ms, (decode_tokens, _) in steps for _ in range(decode_tokens)]  # one per decoded token
    figures = {"decode step p50 ms": percentile(with_decodes, 50), "decode step p95 ms": percentile(with_decodes, 95),
               "decode step max ms": max(with_decodes), "per decoded token p95 ms": percentile(gaps, 95)}
    print(f"max_step_ms {max_step_ms}: {len(steps)} steps in {time.monotonic() - start:.1f} s; steps with decodes "
          f"p50 {figures['decode step p50 ms']:.0f} / p95 {figures['decode step p95 ms']:.0f} / "
          f"max {figures['decode step max ms']:.0f} ms; per decoded token p95 {figures['per decoded token p95 ms']:.0f} "
          f"ms; fitted a, b, c = {', '.join(f'{c:.2f}' for c in engine.step_cost.coefficients)}")
    return figures


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="6 prompts")
    p.add_argument("--max-step-ms", type=int, nargs="+", default=[0, 120])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--rate", type=float, default=0.8)
    args = p.parse_args(argv)
    apply_quick(p, args, prompts=6)
    figures = Figures()
    for ms in args.max_step_ms:
        for name, value in run(ms, args.prompts, args.rate).items():
            figures.add(name, f"max_step_ms {ms}", value)
    figures.finish(args, "step times by --max-step-ms", "ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
