"""The native decoder (kernels/csrc/decoder_layers.c) against the layer-by-layer path, step by step.

    .venv/bin/python -m bench.bench_native_decoder                      # decode steps and mixed steps
    .venv/bin/python -m bench.bench_native_decoder --batches 1 8 --chunks 40 --plot native.png

Two engines on the default model, stepping in turns: `native` (the default: a step whose
rows fit runs every layer in one C call, prefill chunks of small steps as single-query rows)
and `layers` (`native_decoder=False`, `--no-native-decoder`: layer by layer from Python,
prefill chunks through SDPA), each with the same requests.
  decode    --batches requests of --context-token prompts, then --steps decode steps each
  mixed     8 decoding requests, then a --prompt-token prompt computed in --chunks-token chunks
            (chunked_prefill_size), every step of it timed
Reported: median ms per step of each and the ratio layers / native (in the same run), and
whether the greedy tokens of the two engines agree. Run it alone: two cores, one benchmark.
"""

from __future__ import annotations

import statistics
import time

from bench.lib.cli import apply_quick, bench_parser, write_json
from bench.lib.harness import progress, seeded_prompt, settle
from bench.lib.report import plot_bars
from radixserve import Engine, SamplingParams

NAMES = ("native", "layers")


def twin_engines(**config) -> dict[str, Engine]:
    return {name: Engine(native_decoder=name == "native", **config) for name in NAMES}


def decode_steps(batch: int, context: int, steps: int) -> tuple[dict[str, float], bool]:
    engines = twin_engines()
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for engine in engines.values():
        for i in range(batch):
            engine.add_request(seeded_prompt(i, context), params)
        settle(engine)
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    for _ in range(steps):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t0)
    outputs = {name: sorted(r.output_token_ids for r in e.scheduler.running) for name, e in engines.items()}
    return {name: statistics.median(t) * 1000 for name, t in times.items()}, outputs["native"] == outputs["layers"]


def mixed_steps(chunk: int, prompt_len: int, repeats: int) -> dict[str, float]:
    engines = twin_engines(chunked_prefill_size=chunk)
    params = SamplingParams(max_tokens=4 * prompt_len, temperature=0.0, ignore_eos=True)
    for engine in engines.values():
        for i in range(8):
            engine.add_request(seeded_prompt(i, 300), params)
        settle(engine)
    times: dict[str, list[float]] = {name: [] for name in NAMES}
    for repeat in range(repeats):
        for name, engine in engines.items():
            engine.add_request(seeded_prompt(50 + repeat, prompt_len), params)
            while engine.scheduler.waiting or any(r.in_prefill for r in engine.scheduler.running):
                t0 = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="batches 1 and 8, 10 steps, 40-token chunks, one prompt",
                     plot="write a bar chart of ms per step here (PNG)")
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--chunks", type=int, nargs="*", default=[16, 40, 100])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2, help="prompts per chunk size in the mixed runs")
    args = p.parse_args(argv)
    apply_quick(p, args, batches=[1, 8], steps=10, chunks=[40], repeats=1)
    print("native decoder vs layer-by-layer path, default model, two engines stepping in turns")
    groups, series, rows = [], {name: [] for name in NAMES}, []
    bar = progress(len(args.batches) + len(args.chunks), "configurations")

    def record(group: str, what: str, ms: dict[str, float], note: str = "") -> None:
        rows.append(f"{what}: native {ms['native']:7.2f} ms  layers {ms['layers']:7.2f} ms  "
                    f"layers/native {ms['layers'] / ms['native']:.3f}x{note}")
        groups.append(group)
        for name in NAMES:
            series[name].append(ms[name])
        bar.update(1)

    for batch in args.batches:
        ms, same = decode_steps(batch, args.context, args.steps)
        record(f"decode b{batch}", f"decode  batch {batch:3d}, {args.context}-token prompts", ms,
               f"  greedy tokens equal: {same}")
    for chunk in args.chunks:
        ms = mixed_steps(chunk, args.prompt, args.repeats)
        record(f"8 + {chunk}", f"mixed   8 decodes + {chunk:3d}-token chunks of a {args.prompt}-token prompt", ms)
    bar.close()
    print("\n".join(rows))
    if args.json:
        write_json(args.json, {"groups": groups, "ms_per_step": series}, args)
    if args.plot:
        plot_bars(args.plot, "ms per step: native decoder vs layer path", groups, series, "ms per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
