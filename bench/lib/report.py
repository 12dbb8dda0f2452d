"""Printed tables and optional plots for the benchmarks."""

from __future__ import annotations

from bench.lib.harness import RunResult


def print_header(title: str, lines: list[str]) -> None:
    print()
    print("=" * 100)
    print(title)
    for line in lines:
        print(f"  {line}")
    print("=" * 100)


def print_table(results: list[RunResult], ideal_cached: int | None = None) -> None:
    head = f"{'system':<26}{'wall s':>9}{'gen tok/s':>11}{'total tok/s':>13}{'TTFT p50':>10}{'TTFT p99':>10}"
    if ideal_cached is not None:
        head += f"{'cached':>9}{'ideal':>9}{'of ideal':>10}"
    print(head)
    for r in results:
        line = (
            f"{r.system:<26}{r.wall_s:>9.1f}{r.generated_per_s:>11.1f}{r.total_per_s:>13.1f}"
            f"{r.ttft(50):>9.2f}s{r.ttft(99):>9.2f}s"
        )
        if ideal_cached is not None:
            if r.cached_prompt_tokens is None:
                line += f"{'-':>9}{ideal_cached:>9}{'-':>10}"
            elif ideal_cached:
                share = r.cached_prompt_tokens / ideal_cached
                line += f"{r.cached_prompt_tokens:>9}{ideal_cached:>9}{share:>9.1%} "
            else:
                line += f"{r.cached_prompt_tokens:>9}{ideal_cached:>9}{'-':>10}"
        print(line)


def ratio_line(name: str, a: RunResult, b: RunResult, target: float | None = None) -> str:
    ratio = a.generated_per_s / b.generated_per_s
    total = a.total_per_s / b.total_per_s
    verdict = "" if target is None else ("  [meets target]" if ratio >= target else "  [BELOW target]")
    goal = "" if target is None else f" (target >= {target:g}x)"
    return f"{name}: {ratio:.2f}x generated tok/s, {total:.2f}x total tok/s{goal}{verdict}"


def plot_bars(path: str, title: str, groups: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(groups)), 4))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")
