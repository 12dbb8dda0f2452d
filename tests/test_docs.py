"""The documentation: the mkdocs site under docs/ builds in strict mode, and the README stays a
newcomer's first hour (at most 300 lines, the CI's own test command, the map as its third section)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 300


def _ci_test_command() -> str:
    """The command .ci/run runs: its one line that calls pytest."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#") and "pytest" in line]
    assert len(commands) == 1, f".ci/run should run pytest on one line, found {commands}"
    return commands[0]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    # A broken link, a missing anchor or a nav entry without a page fails the build.
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert "No module named mkdocs" not in result.stderr, (
        "mkdocs is missing: it is in the test extra; run ./scripts/setup.sh "
        "(or .venv/bin/pip install -c constraints.txt -e '.[test]')")
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_is_short() -> None:
    count = len(README.read_text().splitlines())
    assert count <= README_MAX_LINES, (
        f"README.md has {count} lines (at most {README_MAX_LINES}): move details into docs/")


def test_readme_names_the_ci_test_command() -> None:
    command = _ci_test_command()
    assert command == "./scripts/setup.sh && .venv/bin/pytest -q -n 2"
    assert command in README.read_text(), f"README.md should give the test command .ci/run runs: {command}"


def test_readme_architecture_map_is_the_third_section() -> None:
    sections = re.findall(r"^## (.+)$", README.read_text(), flags=re.MULTILINE)
    assert len(sections) >= 3 and "architecture" in sections[2].lower(), sections


def _map_tree() -> str:
    """The README map's file tree (the code block that starts with `radixserve/`)."""
    return next(block for block in re.findall(r"```\n(radixserve/\n.*?)```", README.read_text(), flags=re.S))


def test_readme_architecture_map_names_files_that_exist() -> None:
    """Every file and folder the map's tree names is in the package (the map stays true)."""
    tree = _map_tree()
    folder, missing = None, []
    for line in tree.splitlines()[1:]:
        match = re.match(r"^  (  )?(\S+)", line)
        if not match or match.group(2) in ("tests/", "bindings"):
            continue
        name = match.group(2)
        path = ROOT / "radixserve" / (name if match.group(1) is None else f"{folder}{name}")
        if match.group(1) is None:
            folder = name if name.endswith("/") else None
        if not path.exists():
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"the README's architecture map names what is not there: {missing}"


def test_readme_architecture_map_lists_every_module_of_the_folders_it_opens() -> None:
    """A folder whose files the map lists one by one lists all of them (a new module gets its line)."""
    tree = _map_tree()
    listed: dict[str, set[str]] = {}
    folder = None
    for line in tree.splitlines()[1:]:
        top, nested = re.match(r"^  (\S+)", line), re.match(r"^    (\S+)", line)
        if top:
            folder = top.group(1) if top.group(1).endswith("/") else None
        elif nested and folder:
            listed.setdefault(folder, set()).add(nested.group(1))
    assert listed, "the map lists no folder's files"
    unlisted = [f"{folder}{module.name}" for folder, names in listed.items()
                for module in sorted((ROOT / "radixserve" / folder).glob("*.py"))
                if module.name != "__init__.py" and module.name not in names]
    assert not unlisted, f"the README's architecture map leaves out: {unlisted}"
