"""DSL benchmark: programs through radixserve.lang with the prefix cache on, off, and on a
naive transformers evaluator, in the same run.

    python -m bench.bench_dsl [--workloads few-shot-select,tree-of-thought] [--questions 16]
                              [--problems 3] [--skip-hf] [--plot dsl.png] [--json dsl.json]

few-shot-select: HellaSwag-style questions (a 20-shot block of solved items, then a
context and 4 endings) answered by `select`, all questions through `run_batch`.
tree-of-thought: one program per problem that forks proposals, judges each with a yes/no
`select` on a fork, and expands the best (fixed-length sampled gens, EOS ignored, so every
system generates the same number of tokens).

Systems: radixserve cache-on (rl.Runtime()), radixserve cache-off
(rl.Runtime(enable_prefix_cache=False)), and transformers as a naive evaluator (one full
forward pass per (question, ending), one `generate` per gen, one call at a time; the same
DSL programs drive it). It prints questions (programs) per second, logical tokens per
second (every prompt token asked for, cached or not, plus generated tokens), the prefix
cache hit rate, the accuracy and the ratios cache-on / cache-off and cache-on / transformers.
Target: cache-on >= 4x cache-off on few-shot-select.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import asdict, dataclass, field

import radixserve.lang as rl
from bench.lib.cli import apply_quick, bench_parser, write_json
from bench.lib.dsl_backends import MeteredBackend, NaiveTransformersBackend
from bench.lib.dsl_workloads import choose_ending, hellaswag_like, tot_problems, tree_of_thought
from bench.lib.report import plot_bars, print_header

WORKLOADS = ("few-shot-select", "tree-of-thought")
SYSTEMS = ("radixserve cache-on", "radixserve cache-off", "transformers naive")
TARGET_X_CACHE_OFF = 4.0


@dataclass
class Result:
    system: str
    workload: str
    units: int  # questions or programs
    wall_s: float
    prompt_tokens: int  # logical: every prompt token asked for, served from the cache or not
    generated_tokens: int
    computed_tokens: int | None  # what the engine ran through the model
    hit_rate: float | None
    accuracy: float | None = None
    picks: list[int] = field(default_factory=list)

    @property
    def units_per_s(self) -> float:
        return self.units / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.generated_tokens) / self.wall_s


def main() -> None:
    parser = bench_parser(__doc__, quick="8 questions of 10 shots, 2 programs of width 2",
                          plot="write a bar chart of throughput here (PNG)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--questions", type=int, default=16, help="few-shot-select questions")
    parser.add_argument("--shots", type=int, default=20)
    parser.add_argument("--problems", type=int, default=3, help="tree-of-thought programs")
    parser.add_argument("--width", type=int, default=3)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--step-tokens", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true", help="do not run the transformers evaluator")
    args = parser.parse_args()
    apply_quick(parser, args, questions=8, shots=10, problems=2, width=2)

    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s): {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    systems = [s for s in SYSTEMS if not (args.skip_hf and s.startswith("transformers"))]
    summary: dict[str, dict] = {}
    for name in names:
        workload = _workload(name, args)
        print_header(f"workload {name}", workload["description"] + ["default model, float32 on CPU"])
        results = [_run_system(system, workload) for system in systems]
        _print_results(results, workload["unit"])
        summary[name] = {"results": [_as_dict(r) for r in results], "ratios": _print_ratios(name, results)}
    if args.json:
        write_json(args.json, {"workloads": summary}, args)
    if args.plot:
        series = {s: [_find(summary[w], s).get("units_per_s", 0.0) for w in names] for s in systems}
        plot_bars(args.plot, "radixserve.lang programs: throughput", names, series, "questions or programs / s")


# ---- workloads ---------------------------------------------------------------------------


def _workload(name: str, args: argparse.Namespace) -> dict:
    if name == "few-shot-select":
        block, questions = hellaswag_like(args.questions, args.shots)
        batch = [{"block": block, "context": q.context, "endings": q.endings} for q in questions]
        return {
            "name": name, "program": choose_ending, "batch": batch, "unit": "questions", "options": {},
            "labels": [q.label for q in questions],
            "description": [
                f"{args.questions} HellaSwag-style questions (synthetic sentences, seeded): a {args.shots}-shot "
                f"block of solved items, a context, 4 endings",
                "each question: rl.select over the 4 endings (total log-probability); all through run_batch",
            ],
        }
    problems = tot_problems(args.problems)
    batch = [
        {"problem": p, "width": args.width, "depth": args.depth, "keep": args.keep, "step_tokens": args.step_tokens}
        for p in problems
    ]
    return {
        "name": name, "program": tree_of_thought, "batch": batch, "unit": "programs",
        "options": {"temperature": 0.8}, "labels": None,
        "description": [
            f"{args.problems} tree-of-thought programs through run_batch: width {args.width}, depth {args.depth}, "
            f"keep {args.keep}; fork per proposal, yes/no select per judge, {args.step_tokens}-token gens "
            f"(sampled, EOS ignored)",
        ],
    }


def _run_system(system: str, workload: dict) -> Result:
    backend = _backend(system)
    try:
        _warm_up(backend)
        metered = MeteredBackend(backend)
        before = backend.stats()
        start = time.perf_counter()
        states = workload["program"].run_batch(
            workload["batch"], backend=metered, progress_bar=True, **workload["options"]
        )
        wall = time.perf_counter() - start
        after = backend.stats()
    finally:
        backend.shutdown()
        del backend
        gc.collect()
    for state in states:
        if state.error() is not None:
            raise state.error()
    return _result(system, workload, states, metered, wall, before, after)


def _backend(system: str) -> rl.Backend:
    if system == "radixserve cache-on":
        return rl.Runtime()
    if system == "radixserve cache-off":
        return rl.Runtime(enable_prefix_cache=False)
    from radixserve.model.default_model import ensure_default_model

    return NaiveTransformersBackend(str(ensure_default_model()))


def _warm_up(backend: rl.Backend) -> None:
    """One small program on text unlike the workload's, then a cold cache."""
    state = rl.ProgramState(backend, {"temperature": 0.0})
    state += "Warm-up: count to three." + rl.select("x", choices=[" one", " two"]) + rl.gen("y", max_tokens=4)
    state.sync()
    if isinstance(backend, rl.Runtime):
        backend.flush_cache()


def _result(system, workload, states, metered, wall, before, after) -> Result:
    engine = "computed_tokens" in after
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    result = Result(
        system, workload["name"], len(states), wall, metered.prompt_tokens, metered.generated_tokens,
        after["computed_tokens"] - before["computed_tokens"] if engine else None,
        (cached / prompt if prompt else 0.0) if engine else None,
    )
    if workload["labels"] is not None:
        result.picks = [s.scores("ending").index for s in states]
        result.accuracy = sum(p == y for p, y in zip(result.picks, workload["labels"])) / len(states)
    return result


# ---- report ------------------------------------------------------------------------------


def _print_results(results: list[Result], unit: str) -> None:
    print(f"{'system':<24}{'wall s':>9}{unit + '/s':>14}{'tokens/s':>11}{'computed':>10}{'hit rate':>10}{'accuracy':>10}")
    for r in results:
        computed = f"{r.computed_tokens}" if r.computed_tokens is not None else "-"
        accuracy = f"{r.accuracy:.1%}" if r.accuracy is not None else "-"
        hit_rate = f"{r.hit_rate:.1%}" if r.hit_rate is not None else "-"
        print(
            f"{r.system:<24}{r.wall_s:>9.1f}{r.units_per_s:>14.2f}{r.tokens_per_s:>11.0f}{computed:>10}"
            f"{hit_rate:>10}{accuracy:>10}"
        )
    print(f"(tokens/s: logical prompt tokens of every gen and scored choice, {results[0].prompt_tokens} in all, "
          f"plus {results[0].generated_tokens} generated; computed: tokens the engine actually ran)")
    if results[0].picks:
        agree = [sum(a == b for a, b in zip(results[0].picks, r.picks)) for r in results[1:]]
        print(f"choices equal to cache-on's: {', '.join(f'{r.system} {a}/{r.units}' for r, a in zip(results[1:], agree))}")


def _print_ratios(name: str, results: list[Result]) -> dict[str, float]:
    on = results[0]
    ratios = {}
    for other in results[1:]:
        ratio = on.units_per_s / other.units_per_s
        key = f"cache-on / {other.system}"
        ratios[key] = ratio
        verdict = ""
        if name == "few-shot-select" and other.system == "radixserve cache-off":
            met = "meets" if ratio >= TARGET_X_CACHE_OFF else "BELOW"
            verdict = f"  (target >= {TARGET_X_CACHE_OFF:g}x: {met} target)"
        print(f"{key}: {ratio:.2f}x {'questions' if name == 'few-shot-select' else 'programs'}/s{verdict}")
    return ratios


def _as_dict(result: Result) -> dict:
    out = asdict(result)
    out.update(units_per_s=result.units_per_s, tokens_per_s=result.tokens_per_s)
    return out


def _find(summary: dict, system: str) -> dict:
    return next((r for r in summary["results"] if r["system"] == system), {})


if __name__ == "__main__":
    main()
