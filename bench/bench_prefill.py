"""Prefill: the large matmuls on oneDNN against torch's MKL, whole prompts, engine to engine.

    .venv/bin/python -m bench.bench_prefill                       # prompts of 128-1024 tokens
    .venv/bin/python -m bench.bench_prefill --lengths 512 --repeats 5 --plot prefill.png

Two engines on the default model, taking turns on the same prompts: `onednn` (the default:
float32 matmuls with more rows than the skinny kernel takes run on oneDNN) and `mkl`
(`onednn_linear=False`, `--no-onednn-linear`: torch's F.linear, MKL). Each request is one
prompt of --lengths random tokens and one greedy token, with the prefix cache off, so the
time is the prompt's prefill (in one step: chunked_prefill_size is raised to the longest
prompt). Reported per length: the best of --repeats in ms and ms per token of each, the
ratio mkl / onednn measured in the same run, and whether the two chose the same first token.
The best of the repeats hides any one-off cost of a row count seen for the first time.
Run it alone: two cores, one benchmark.
"""

from __future__ import annotations

import argparse
import random
import time

from bench.harness import progress
from bench.report import plot_bars
from radixserve import Engine, SamplingParams

NAMES = ("onednn", "mkl")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="*", default=[128, 256, 512, 1024])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--plot", help="write a bar chart of ms per prompt token here")
    args = p.parse_args(argv)
    longest = max(args.lengths)
    engines = {
        name: Engine(onednn_linear=name == "onednn", enable_prefix_cache=False, chunked_prefill_size=longest,
                     max_num_batched_tokens=max(longest, 2048))
        for name in NAMES
    }
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(0)
    print("prefill, default model, one prompt at a time: oneDNN matmuls vs MKL, two engines in turns")
    bar = progress(len(args.lengths) * args.repeats, "prompts")
    rows, groups, series = [], [], {name: [] for name in NAMES}
    for length in args.lengths:
        best = {name: float("inf") for name in NAMES}
        same = True
        for _ in range(args.repeats):
            ids = [rng.randrange(100, 40000) for _ in range(length)]
            first = {}
            for name, engine in engines.items():
                t0 = time.perf_counter()
                first[name] = engine.generate([ids], params, use_tqdm=False)[0].token_ids
                best[name] = min(best[name], time.perf_counter() - t0)
            same = same and first["onednn"] == first["mkl"]
            bar.update(1)
        ms = {name: best[name] * 1000 for name in NAMES}
        rows.append(f"{length:5d} tokens: onednn {ms['onednn']:7.1f} ms ({ms['onednn'] / length:.2f} ms/token)  "
                    f"mkl {ms['mkl']:7.1f} ms ({ms['mkl'] / length:.2f} ms/token)  mkl/onednn "
                    f"{ms['mkl'] / ms['onednn']:.2f}x  same first token: {same}")
        groups.append(str(length))
        for name in NAMES:
            series[name].append(ms[name] / length)
    bar.close()
    print("\n".join(rows))
    if args.plot:
        plot_bars(args.plot, "prefill ms per prompt token: oneDNN vs MKL", groups, series, "ms per token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
