"""Every bench takes the same --json PATH, --plot PATH and --quick, through bench/lib/cli.py's one
parser helper, and the benches share one percentile and one SSE client. Each bench's parser is
caught as its main() parses (no bench runs)."""

from __future__ import annotations

import argparse
import importlib
import json
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
# The runners: every module of bench/ but its package file; the shared code is in bench/lib/.
MODULES = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _parser_of(name: str, monkeypatch) -> argparse.ArgumentParser:
    module = importlib.import_module(f"bench.{name}")

    def catch(self, args=None, namespace=None):
        raise _Caught(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    monkeypatch.setattr("sys.argv", [name])
    with pytest.raises(_Caught) as caught:
        module.main()
    return caught.value.parser


@pytest.mark.parametrize("name", MODULES)
def test_every_bench_takes_json_plot_and_quick(name, monkeypatch):
    parser = _parser_of(name, monkeypatch)
    monkeypatch.undo()
    args = parser.parse_args(["--json", "out.json", "--plot", "out.png", "--quick"])
    assert (args.json, args.plot, args.quick) == ("out.json", "out.png", True)
    assert parser.parse_args([]).quick is False
    groups = [g.title for g in parser._action_groups]
    assert "every bench" in groups, f"{name} builds its parser without bench.lib.cli.bench_parser"


def test_the_benches_share_one_percentile_and_one_sse_reader():
    own = []
    for path in sorted(BENCH.rglob("*.py")):
        if path.relative_to(BENCH).as_posix() in ("lib/harness.py", "lib/client.py"):
            continue
        text = path.read_text()
        if re.search(r"^def _?(pct|p\d\d|percentile|quantile)\(", text, re.M):
            own.append(f"{path.name}: a percentile of its own (use bench.lib.harness.percentile)")
        if 'startswith("data: ' in text:
            own.append(f"{path.name}: reads SSE lines itself (use bench.lib.client)")
    assert not own, own


def test_percentile_is_linear_between_ranks():
    from bench.lib.harness import percentile

    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, None, 2.0], 100) == 2.0
    assert percentile([], 50) != percentile([], 50)  # nan


def test_quick_takes_the_smaller_defaults_unless_given():
    from bench.lib.cli import apply_quick, bench_parser

    parser = bench_parser(None, quick="fewer rows")
    parser.add_argument("--rows", type=int, default=32)
    for argv, rows in ((["--quick"], 4), (["--quick", "--rows", "8"], 8), ([], 32), (["--quick", "--rows=32"], 32)):
        args = parser.parse_args(argv)
        apply_quick(parser, args, rows=4)
        assert args.rows == rows


def test_figures_write_the_json_and_the_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.lib.cli import Figures

    figures = Figures()
    figures.add("batch 1", "native", 11.5)
    figures.add("batch 1", "layers", 14.0, steps=40)
    figures.add("batch 8", "native", 15.0)
    args = argparse.Namespace(json=str(tmp_path / "f.json"), plot=str(tmp_path / "f.png"), quick=False)
    figures.finish(args, "ms per step", "ms")
    written = json.loads((tmp_path / "f.json").read_text())
    assert written["args"]["quick"] is False
    assert written["figures"][1] == {"group": "batch 1", "series": "layers", "value": 14.0, "steps": 40}
    assert (tmp_path / "f.png").stat().st_size > 0


def test_every_bench_is_listed_as_a_system_bench_or_a_kernel_micro_bench():
    import bench

    doc = bench.__doc__
    system, micro = doc.split("The library")[0].split("Kernel micro-benches")
    system = system.split("System benches")[1]
    listed = {line.split()[0] for part in (system, micro) for line in part.splitlines()[1:] if line.startswith("    ")}
    assert not set(MODULES) - listed, "bench/__init__.py lists neither as a system nor as a kernel bench"
    assert not listed - set(MODULES), "bench/__init__.py lists a bench that is not there"
