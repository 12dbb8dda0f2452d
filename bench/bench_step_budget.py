"""The step budget inside the engine (no HTTP): Poisson arrivals of the no-sharing workload fed
to Engine.step directly; step times of steps that carry decodes, p50 / p95 / max, and the fitted
cost model, for each --max-step-ms given.

    .venv/bin/python -m bench.bench_step_budget --max-step-ms 0 120 --prompts 12
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from bench import workloads
from radixserve import Engine, SamplingParams


def run(max_step_ms: int, prompts: int, rate: float) -> None:
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
    with_decodes = sorted(ms for ms, (decode_tokens, _) in steps if decode_tokens)
    gaps = sorted(ms for ms, (decode_tokens, _) in steps for _ in range(decode_tokens))  # one per decoded token
    print(f"max_step_ms {max_step_ms}: {len(steps)} steps in {time.monotonic() - start:.1f} s; steps with decodes "
          f"p50 {statistics.median(with_decodes):.0f} / p95 {with_decodes[int(0.95 * len(with_decodes))]:.0f} / "
          f"max {with_decodes[-1]:.0f} ms; per decoded token p95 {gaps[int(0.95 * len(gaps))]:.0f} ms; "
          f"fitted a, b, c = {', '.join(f'{c:.2f}' for c in engine.step_cost.coefficients)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-step-ms", type=int, nargs="+", default=[0, 120])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--rate", type=float, default=0.8)
    args = p.parse_args(argv)
    for ms in args.max_step_ms:
        run(ms, args.prompts, args.rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
