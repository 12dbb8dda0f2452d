"""bench/ as a library: the runners (bench/*.py) import shared code only from bench/lib/, never
from one another, and bench/lib/ imports no runner; no bench names a machine's path to a peer
server (llama.cpp is found through --llama-server or LLAMA_SERVER); one `Workload` concept."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
RUNNERS = sorted(p for p in BENCH.glob("*.py") if p.name != "__init__.py")
LIBRARY = sorted((BENCH / "lib").glob("*.py"))


def _bench_imports(path: Path) -> list[str]:
    """Every bench module `path` imports, anywhere in it (function-level imports included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "bench":
                names += [f"bench.{alias.name}" for alias in node.names]
            elif node.module.startswith("bench."):
                names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names if alias.name.startswith("bench.")]
    return names


def test_runners_import_only_the_library():
    wrong = [f"{path.name} imports {name}" for path in RUNNERS for name in _bench_imports(path)
             if not (name == "bench.lib" or name.startswith("bench.lib."))]
    assert RUNNERS and not wrong, wrong


def test_the_library_imports_no_runner():
    wrong = [f"lib/{path.name} imports {name}" for path in LIBRARY for name in _bench_imports(path)
             if not (name == "bench.lib" or name.startswith("bench.lib."))]
    assert LIBRARY and not wrong, wrong


def test_no_bench_names_a_machine_path_to_a_server():
    found = []
    for path in sorted(BENCH.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("/")
                    and Path(node.value).name in ("llama-server", "llama-cli", "server")):
                found.append(f"{path.relative_to(BENCH)}:{node.lineno}: {node.value}")
    assert not found, found


def test_one_class_is_named_workload():
    """The kinds of workload are named for what they are (TokenSessions, ChatSessions,
    AgentSwarm, ...); `Workload` is their one shared concept, in bench/lib/workloads.py."""
    named = [path.relative_to(BENCH).as_posix() for path in sorted(BENCH.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.ClassDef) and node.name == "Workload"]
    assert named == ["lib/workloads.py"], named


def test_every_kind_of_workload_has_a_name_and_describes_itself():
    from bench.bench_agent_turns import QUICK as tool_loops
    from bench.lib.chat_sessions import ChatSessions
    from bench.lib.swarm import QUICK_SWARM
    from bench.lib.workloads import WORKLOADS

    kinds = [make() for make in WORKLOADS.values()] + [ChatSessions(), QUICK_SWARM, tool_loops]
    for workload in kinds:
        assert workload.name and workload.describe(), workload
    assert [w.name for w in kinds[:len(WORKLOADS)]] == list(WORKLOADS)

