"""Where a prompt (extend) step's time goes: the agent swarm's shape on Gemma 3 by default.

    .venv/bin/python -m bench.profile_prompt                    # 8 extends of 144 tokens, Gemma 3, hybrid KV
    .venv/bin/python -m bench.profile_prompt --extends 4 --extend-tokens 256 --reps 5
    .venv/bin/python -m bench.profile_prompt --torch-profile      # plus torch's profiler, one step

Each of --extends agents first computes its own prefix (a shared --prefix-tokens prompt, then
its own history: agent i's is i * --history-step tokens), so its cache holds it; then each
repetition appends --extend-tokens new tokens to every agent's conversation (a multiple of the
block size: the cached prefix is the whole conversation so far, as an agent's next turn finds
it) and times the one step that computes them all. Phases, median ms
per step: step (engine.step), prepare (the runner's tensors), plan (attention plans),
quantized matmuls (Linear layers), attention (the backend: store, kernel, its tensors),
kernel (the tiled prompt kernel alone, inside attention), norms (RMSNorm and q/k norms),
rope, gelu (the MLP's gate), head (final norm rows through the lm head), sample, other
(the median step less the other phases' medians: Python, residual adds, reshapes, the scheduler).
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time

from bench.lib.cli import Figures, apply_quick, bench_parser
from radixserve import Engine, SamplingParams

PHASES = ("step", "prepare", "plan", "matmuls", "attention", "kernel", "norms", "rope", "gelu", "head", "sample")


class Timers:
    """Wall time of wrapped callables, summed per phase within a step."""

    def __init__(self):
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self._undo: list = []

    def wrap(self, owner, name: str, phase: str) -> None:
        original = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
        current = self.current

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                current[phase] = current.get(phase, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def close_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current.clear()

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)

    def medians(self) -> dict[str, float]:
        keys = {k for s in self.steps for k in s}
        return {k: statistics.median(s.get(k, 0.0) for s in self.steps) * 1000 for k in keys}


def instrument(engine: Engine, timers: Timers) -> None:
    import radixserve.model.gemma3 as gemma3
    import radixserve.model.llama as llama
    from radixserve.model.layers import Linear, RMSNorm

    runner = engine.runner
    timers.wrap(runner, "_prepare", "prepare")
    timers.wrap(runner.backend, "prepare", "plan")
    timers.wrap(Linear, "forward", "matmuls")
    timers.wrap(type(runner.backend), "forward", "attention")
    kernels = getattr(runner.backend, "_kernels", None)
    if kernels is not None:
        timers.wrap(kernels, "prefill", "kernel")
    timers.wrap(RMSNorm, "forward", "norms")
    timers.wrap(llama, "rms_norm_heads_", "norms")
    timers.wrap(llama, "apply_rotary", "rope")
    timers.wrap(gemma3, "gelu_tanh_mul", "gelu")
    timers.wrap(runner.model, "logits", "head")
    timers.wrap(type(runner.sampler), "__call__", "sample")


def agent_prefixes(args, vocab: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(*vocab) for _ in range(args.prefix_tokens)]
    return [shared + [rng.randrange(*vocab) for _ in range(i * args.history_step)] for i in range(args.extends)]


def run_step(engine: Engine, prompts: list[list[int]], timers: Timers) -> tuple[float, int]:
    """Add the prompts, time the one step that computes them; (seconds, cached tokens)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    t0 = time.perf_counter()
    outs = engine.step()
    elapsed = time.perf_counter() - t0
    timers.current["step"] = elapsed
    timers.close_step()
    finished = {o.request_id: o for o in outs if o.finished}
    if len(finished) < len(rids):
        raise SystemExit("the step did not take every extend (a token budget?): raise max_num_batched_tokens")
    return elapsed, sum(finished[r].cached_tokens for r in rids)


def profile(engine: Engine, args, timers: Timers) -> list[tuple[float, int]]:
    vocab = (1000, engine.runner.spec.vocab_size - 1000)
    prompts = agent_prefixes(args, vocab)
    engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    rng = random.Random(1)
    runs = []
    for rep in range(args.warmup + args.reps):
        prompts = [p + [rng.randrange(*vocab) for _ in range(args.extend_tokens)] for p in prompts]
        if rep == args.warmup:
            timers.steps.clear()
            instrument(engine, timers)
        runs.append(run_step(engine, prompts, timers))
    timers.restore()
    return runs[args.warmup:]


def report(timers: Timers, runs: list[tuple[float, int]], args) -> Figures:
    m = timers.medians()
    inside = sum(m.get(k, 0.0) for k in PHASES if k not in ("step", "kernel"))
    m["other"] = m["step"] - inside
    first = args.prefix_tokens + args.warmup * args.extend_tokens
    last = first + (args.extends - 1) * args.history_step + (len(runs) - 1) * args.extend_tokens
    cached = " ".join(str(c) for _, c in runs)
    print(f"{args.extends} extends of {args.extend_tokens} tokens over {first}-{last}-token cached prefixes "
          f"(cached tokens a step: {cached}), median of {len(runs)} steps, ms:")
    figures = Figures()
    for key in (*PHASES, "other"):
        share = m.get(key, 0.0) / m["step"] * 100
        print(f"  {key:10s} {m.get(key, 0.0):9.1f}  {share:5.1f}%")
        figures.add("prompt step", key, m.get(key, 0.0))
    print("  steps: " + " ".join(f"{s * 1000:.0f}" for s, _ in runs))
    return figures


def torch_profile(engine: Engine, args) -> None:
    from torch.profiler import ProfilerActivity, profile as tprofile

    vocab = (1000, engine.runner.spec.vocab_size - 1000)
    rng = random.Random(2)
    prompts = [p + [rng.randrange(*vocab) for _ in range(args.extend_tokens)] for p in agent_prefixes(args, vocab)]
    engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    prompts = [p + [rng.randrange(*vocab) for _ in range(args.extend_tokens)] for p in prompts]
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        run_step(engine, prompts, Timers())
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="3 repetitions")
    p.add_argument("--model", default="gemma3-270m", help="a model name or path")
    p.add_argument("--extends", type=int, default=8, help="requests extended in the one step")
    p.add_argument("--extend-tokens", type=int, default=144)
    p.add_argument("--prefix-tokens", type=int, default=1536, help="the prompt every agent shares")
    p.add_argument("--history-step", type=int, default=64, help="agent i's own history: i times this")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--torch-profile", action="store_true")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an engine option (repeatable), e.g. hybrid_kv=off; by default a 1 GiB KV pool, "
                        "prefaulted (a step's first writes into fresh pages would add their faults)")
    args = p.parse_args(argv)
    apply_quick(p, args, reps=3)
    options = {"kv_cache_memory": 1 << 30, "prefault_kv_pool": True, **dict(_option(o) for o in args.option)}
    engine = Engine(args.model, **options)
    timers = Timers()
    runs = profile(engine, args, timers)
    report(timers, runs, args).finish(args, "prompt step phases (median ms)", "ms")
    if args.torch_profile:
        torch_profile(engine, args)
    return 0


def _option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    if value in ("true", "false"):
        return key, value == "true"
    for cast in (int, float):
        with contextlib.suppress(ValueError):
            return key, cast(value)
    return key, value


if __name__ == "__main__":
    sys.exit(main())
