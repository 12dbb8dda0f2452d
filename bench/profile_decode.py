"""Where a decode step's time goes, at batch 1, 8 and 32 on the default model.

    .venv/bin/python -m bench.profile_decode              # phases (median ms over --steps decode steps)
    .venv/bin/python -m bench.profile_decode --torch-profile 8   # plus torch profiler's top ops at batch 8
    .venv/bin/python -m bench.profile_decode --model gemma3-270m --batches 1   # another model

Phases: schedule (scheduler), prepare (the runner's tensors), model (forward incl. attention),
head (the final norm's rows through the lm head, part of model), sample (sampler), post (appending tokens, detokenizing, stop checks), and step (all of them).
The floor is reading the weights once: their bytes over the measured copy bandwidth.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from bench.lib.cli import Figures, apply_quick, bench_parser
from radixserve import Engine, SamplingParams


def _wrap(obj, name: str, sink: dict[str, list[float]], key: str):
    original = getattr(obj, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.setdefault(key, []).append(time.perf_counter() - t0)

    setattr(obj, name, timed)


def profile(engine: Engine, batch: int, steps: int, prompt_len: int) -> dict[str, float]:
    sink: dict[str, list[float]] = {}
    prompts = [[100 + (i * 7919 + j * 31) % 40000 for j in range(prompt_len)] for i in range(batch)]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    while engine.scheduler.waiting or any(r.in_prefill for r in engine.scheduler.running):
        engine.step()
    runner = engine.runner
    _wrap(runner, "_prepare", sink, "prepare")
    _wrap(runner.model, "forward", sink, "model")
    _wrap(runner.model, "logits", sink, "head")
    sampler_class = type(runner.sampler)
    original_call = sampler_class.__call__
    _wrap(sampler_class, "__call__", sink, "sample")  # special methods are looked up on the type
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        sink.setdefault("step", []).append(time.perf_counter() - t0)
        timings = engine.last_step_timings
        sink.setdefault("schedule", []).append(timings["schedule_s"])
        sink.setdefault("post", []).append(timings["postprocess_s"])
    runner.__dict__.pop("_prepare")
    runner.model.__dict__.pop("forward")
    runner.model.__dict__.pop("logits")
    sampler_class.__call__ = original_call
    for rid in engine.unfinished_request_ids():
        engine.abort(rid)
    return {k: statistics.median(v) * 1000 for k, v in sink.items()}


def weights_floor_ms(engine: Engine) -> tuple[float, float]:
    """(ms to read every weight once at the measured copy bandwidth, GB/s)."""
    params = engine.runner.model.weight_bytes()  # quantized weights too
    src = torch.empty(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    bandwidth = 2 * 5 * src.numel() / (time.perf_counter() - t0)  # read + write
    return params / bandwidth * 1000, bandwidth / 1e9


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="batches 1 and 8, 8 steps each")
    p.add_argument("--model", default=None, help="a model name or path (default: the default model)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--torch-profile", type=int, default=0, help="batch to run torch's profiler at")
    args = p.parse_args(argv)
    apply_quick(p, args, batches=[1, 8], steps=8)
    engine = Engine(args.model)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm-up
    floor, gbs = weights_floor_ms(engine)
    print(f"decode step phases (median ms over {args.steps} steps, {args.prompt_len}-token prompts); "
          f"weights-read floor {floor:.1f} ms at {gbs:.1f} GB/s")
    keys = ["step", "schedule", "prepare", "model", "head", "sample", "post"]
    print("batch " + " ".join(f"{k:>9}" for k in keys) + "   outside model")
    figures = Figures()
    for batch in args.batches:
        r = profile(engine, batch, args.steps, args.prompt_len)
        outside = r["step"] - r["model"]
        print(f"{batch:5d} " + " ".join(f"{r.get(k, float('nan')):9.2f}" for k in keys) + f"   {outside:9.2f}")
        for k in keys:
            figures.add(f"batch {batch}", k, r.get(k, float("nan")))
    figures.finish(args, f"decode step phases (median ms; weights-read floor {floor:.1f} ms)", "ms")
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile as tprofile

        prompts = [[100 + i + j for j in range(args.prompt_len)] for i in range(args.torch_profile)]
        for q in prompts:
            engine.add_request(q, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        while any(r.in_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return 0


if __name__ == "__main__":
    sys.exit(main())
