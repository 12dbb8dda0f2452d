"""Prefill, engine to engine: the tiled attention kernel against SDPA, or oneDNN against MKL.

    .venv/bin/python -m bench.bench_prefill                       # attention, 512-8191 tokens + an extend
    .venv/bin/python -m bench.bench_prefill --lengths 512 4096 --extend 0 --plot prefill.png
    .venv/bin/python -m bench.bench_prefill --compare matmul      # oneDNN vs MKL, 128-1024 tokens
    .venv/bin/python -m bench.bench_prefill --compare precision   # float32 vs bf16 dot products in attention
    .venv/bin/python -m bench.bench_prefill --compare bf16-all    # float32 vs bf16 attention and matmuls
    .venv/bin/python -m bench.bench_prefill --compare precision --accuracy --repeats 0 --extend 0  # agreement only

Two engines on the default model take turns on the same prompts. `--compare attention`
(the default): `tiled` (prompt chunks attend through the tiled C kernel over the paged
pool, the default) and `sdpa` (`tiled_prefill_attention=False`: torch's SDPA over
gathered pages). `--compare matmul`: `onednn` (the default: float32 matmuls with more
rows than the skinny kernel takes run on oneDNN) and `mkl` (`onednn_linear=False`).
`--compare precision` (CPUs with AVX512_BF16): the tiled kernel in `float32` (the default)
and with `bfloat16` dot products (`prefill_attention_dtype="bfloat16"`); `--compare bf16-all`:
`float32` against bf16 attention and bf16 layer matmuls (`prefill_matmul_dtype="bfloat16"` too,
oneDNN on a bf16 copy of the weights); "same first token"
then also reports whether bf16's rounding moved a greedy choice. `--accuracy` adds, on real
text (Python's own library sources, --lengths tokens each), the two engines' agreement: the
share of prompt positions in the second half whose most likely next token is the same
(teacher-forced top-1), the mean |difference| of the prompt tokens' logprobs there, and how
many of 32 greedy tokens agree before the first difference.
Each request is one prompt of --lengths random tokens and one greedy token; random
prompts share nothing, so the time is the prompt's prefill, in one step
(chunked_prefill_size is raised to the longest prompt). With --extend N (attention only),
a prompt of --extend-prefix tokens is cached first, then each repeat sends it again with
N new random tokens after it: only those N are computed, attending over the cached prefix.
Reported: the best of --repeats in ms and ms per token of each, the ratio of the two
measured in the same run, each length's cost against the shortest's, and whether the
two chose the same first token. Run it alone: two cores, one benchmark. On a machine that
others load too, `--threads 1 --clock cpu` times the process's CPU seconds on one thread
(run it with OMP_NUM_THREADS=1), which their load hardly moves, where wall time does.
"""

from __future__ import annotations

import argparse
import random
import time

from bench.lib.cli import apply_quick, bench_parser, write_json
from bench.lib.harness import progress
from bench.lib.report import plot_bars
from radixserve import Engine, SamplingParams

OPTIONS = {
    "attention": {"tiled": {"tiled_prefill_attention": True}, "sdpa": {"tiled_prefill_attention": False}},
    "matmul": {"onednn": {"onednn_linear": True}, "mkl": {"onednn_linear": False}},
    "precision": {"float32": {}, "bfloat16": {"prefill_attention_dtype": "bfloat16"}},
    "bf16-all": {"float32": {}, "bfloat16": {"prefill_attention_dtype": "bfloat16", "prefill_matmul_dtype": "bfloat16"}},
}
LENGTHS = {"attention": [512, 2048, 4096, 8191], "matmul": [128, 256, 512, 1024],
           "precision": [512, 2048, 4096, 8191], "bf16-all": [512, 2048, 4096, 8191]}
PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="the two shortest lengths, one repeat, no extend",
                     plot="write a bar chart of ms per prompt token here (PNG)")
    p.add_argument("--compare", choices=sorted(OPTIONS), default="attention")
    p.add_argument("--lengths", type=int, nargs="*", help="prompt lengths (default: 512-8191, or 128-1024)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--extend", type=int, default=256, help="new tokens over a cached prefix (0: none; not "
                   "with --compare matmul)")
    p.add_argument("--extend-prefix", type=int, default=7920, help="tokens of the cached prefix (whole blocks)")
    p.add_argument("--threads", type=int, help="torch CPU threads of each engine (default: torch's)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: the process's CPU time")
    p.add_argument("--accuracy", action="store_true", help="the two engines' agreement on real text (see above)")
    args = p.parse_args(argv)
    apply_quick(p, args, lengths=LENGTHS[args.compare][:2], repeats=1, extend=0)
    lengths = args.lengths or LENGTHS[args.compare]
    extend = args.extend if args.compare != "matmul" and args.repeats > 0 else 0
    timed = lengths if args.repeats > 0 else []  # --repeats 0: --accuracy alone
    longest = max(lengths + [extend])
    names = list(OPTIONS[args.compare])
    engines = {
        name: Engine(enable_prefix_cache=extend > 0, chunked_prefill_size=longest,
                     max_num_batched_tokens=max(longest, 2048), num_threads=args.threads, **options)
        for name, options in OPTIONS[args.compare].items()
    }
    context = next(iter(engines.values())).max_model_len
    if max(lengths) >= context or (extend and args.extend_prefix + extend >= context):
        p.error(f"every prompt must leave room for its token in the model's {context} positions")
    rng = random.Random(0)
    for engine in engines.values():  # one-off costs (first row counts, oneDNN primitives) out of the way
        engine.generate([[rng.randrange(100, 40000) for _ in range(min(lengths))]], PARAMS, use_tqdm=False)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"prefill, default model, one prompt at a time: {' vs '.join(names)}, two engines in turns; "
          f"{args.clock} clock, {args.threads or 'default'} threads")
    bar = progress(len(timed) * args.repeats + (args.repeats + 1) * bool(extend), "prompts")
    groups, series, first_cost, rows = [], {name: [] for name in names}, {}, []
    for length in timed:
        best, same = _best_of(engines, lambda: [rng.randrange(100, 40000) for _ in range(length)], args.repeats, bar,
                              clock)
        first_cost = first_cost or {name: best[name] / length for name in names}
        print(_row(f"{length:5d} tokens", best, length, names, same, first_cost), flush=True)
        rows.append({"tokens": length, "seconds": best, "same_first_token": same})
        groups.append(str(length))
        for name in names:
            series[name].append(best[name] * 1000 / length)
    if extend:
        prefix = [rng.randrange(100, 40000) for _ in range(args.extend_prefix)]
        for engine in engines.values():
            engine.generate([prefix], PARAMS, use_tqdm=False)
        bar.update(1)
        best, same = _best_of(engines, lambda: prefix + [rng.randrange(100, 40000) for _ in range(extend)],
                              args.repeats, bar, clock)
        print(_row(f"{extend} new over {args.extend_prefix} cached", best, extend, names, same, None), flush=True)
        rows.append({"tokens": extend, "cached_prefix": args.extend_prefix, "seconds": best, "same_first_token": same})
    bar.close()
    if args.accuracy:
        _accuracy(engines, lengths)
    if args.json:
        write_json(args.json, rows, args)
    if args.plot and timed:
        plot_bars(args.plot, f"prefill ms per prompt token: {' vs '.join(names)}", groups, series, "ms per token")
    return 0


def _accuracy(engines: dict, lengths: list[int]) -> None:
    """Each length: one prompt of real text; top-1 agreement of the second half's positions,
    mean |logprob difference| of its tokens, and the greedy tokens' agreeing prefix."""
    import inspect

    first, second = engines.values()
    text = "".join(inspect.getsource(module) for module in (argparse, inspect, random))
    corpus = first.tokenizer.encode(text)
    print(f"agreement on real text (Python sources, {len(corpus)} tokens): {' vs '.join(engines)}")
    bar = progress(len(lengths), "prompts")
    for n, length in enumerate(lengths):
        offset = (n * 7919) % max(1, len(corpus) - length)
        ids = corpus[offset : offset + min(length, first.max_model_len - 32)]
        start = len(ids) // 2
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, prompt_logprobs=1,
                                prompt_logprobs_start=start)
        a, b = (engine.generate([ids], params, use_tqdm=False)[0] for engine in (first, second))
        pairs = list(zip(a.prompt_logprobs[start:], b.prompt_logprobs[start:]))
        top1 = sum(x.top[0][0] == y.top[0][0] for x, y in pairs) / len(pairs)
        drift = sum(abs(x.logprob - y.logprob) for x, y in pairs) / len(pairs)
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        bar.update(1)
        print(f"  {len(ids):5d} tokens: top-1 agreement {top1:.2%} over {len(pairs)} positions, mean |logprob "
              f"difference| {drift:.4f} nats, greedy tokens agree for {same}/{len(a.token_ids)}", flush=True)
    bar.close()


def _best_of(engines, make_prompt, repeats: int, bar, clock) -> tuple[dict[str, float], bool]:
    """Each engine's best seconds over `repeats` prompts, taking turns on each; whether
    every engine chose the same first token every time."""
    best = {name: float("inf") for name in engines}
    same = True
    for _ in range(repeats):
        ids = make_prompt()
        first = {}
        for name, engine in engines.items():
            t0 = clock()
            first[name] = engine.generate([ids], PARAMS, use_tqdm=False)[0].token_ids
            best[name] = min(best[name], clock() - t0)
        same = same and len({tuple(t) for t in first.values()}) == 1
        bar.update(1)
    return best, same


def _row(label: str, best: dict[str, float], tokens: int, names: list[str], same: bool, first_cost) -> str:
    a, b = names
    parts = [f"{label}:"]
    for name in names:
        cost = best[name] / tokens
        growth = f", {cost / first_cost[name]:.2f}x the shortest's" if first_cost else ""
        parts.append(f"{name} {best[name] * 1000:8.1f} ms ({cost * 1000:.2f} ms/token{growth})")
    parts.append(f"{b}/{a} {best[b] / best[a]:.2f}x  same first token: {same}")
    return "  ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
