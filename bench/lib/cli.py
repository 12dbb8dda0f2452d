"""The command line every bench shares: `--json PATH` (the figures), `--plot PATH` (a chart of
them, PNG) and `--quick` (a smaller run: fewer sizes, repeats or requests), and what writes them.

    parser = bench_parser(__doc__, quick="two sizes, three repeats")
    parser.add_argument("--rows", default="1,8,32")    # the bench's own options
    args = parser.parse_args(argv)
    apply_quick(parser, args, rows="1,8")              # smaller defaults, unless given
    ...
    figures.finish(args, "ms per call", "ms")          # Figures: --json and --plot from one table
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

class BenchParser(argparse.ArgumentParser):
    """An ArgumentParser that remembers which options the last command line gave (`given`),
    so that --quick never overrides one given, even at its default value."""

    given: frozenset[str] = frozenset()

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extra = super().parse_known_args(args, namespace)
        defaults = [(action, action.default) for action in self._actions]
        try:  # again with every default suppressed: what is left was on the command line
            for action, _ in defaults:
                action.default = argparse.SUPPRESS
            given, _ = super().parse_known_args(args, argparse.Namespace())
        finally:
            for action, default in defaults:
                action.default = default
        self.given = frozenset(vars(given))
        return parsed, extra


def bench_parser(doc: str | None, *, quick: str, plot: str = "write a chart of the figures here (PNG)",
                 json_help: str = "write the figures here (JSON)") -> BenchParser:
    """An ArgumentParser with the three shared flags; `quick` says what --quick leaves out."""
    parser = BenchParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared = parser.add_argument_group("every bench")
    shared.add_argument("--json", metavar="PATH", default=None, help=json_help)
    shared.add_argument("--plot", metavar="PATH", default=None, help=plot)
    shared.add_argument("--quick", action="store_true", help=f"a smaller run: {quick}")
    return parser


def apply_quick(parser: argparse.ArgumentParser, args: argparse.Namespace, **smaller: Any) -> None:
    """With --quick, each named option not given on the command line takes the smaller value."""
    if not args.quick:
        return
    given = getattr(parser, "given", None)  # a plain ArgumentParser: an option at its default was not given
    for name, value in smaller.items():
        at_default = getattr(args, name) == parser.get_default(name)
        if (name not in given) if given is not None else at_default:
            setattr(args, name, value)


def write_json(path: str, figures: Any, args: argparse.Namespace | None = None) -> None:
    """The figures (dataclasses, dicts, lists, numbers) as JSON, with the run's options when given."""
    data = {"args": vars(args), "figures": figures} if args is not None else figures
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=_plain)
    print(f"figures written to {path}")


@dataclasses.dataclass
class Figures:
    """One table of figures: a value per (group, series), in the order added; `finish` writes
    --json (every row) and --plot (bars: groups on the x axis, one bar per series)."""

    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def add(self, group: str, series: str, value: float, **extra: Any) -> None:
        self.rows.append({"group": group, "series": series, "value": value, **extra})

    def finish(self, args: argparse.Namespace, title: str, ylabel: str) -> None:
        if args.json:
            write_json(args.json, self.rows, args)
        if args.plot and self.rows:
            from bench.lib.report import plot_bars

            groups = list(dict.fromkeys(r["group"] for r in self.rows))
            names = list(dict.fromkeys(r["series"] for r in self.rows))
            value = {(r["group"], r["series"]): r["value"] for r in self.rows}
            series = {s: [value.get((g, s), 0.0) for g in groups] for s in names}
            plot_bars(args.plot, title, groups, series, ylabel)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)
