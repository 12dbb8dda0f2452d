"""docs/architecture.md says what the package holds: every module and every package under
radixserve/ is named there (a new module gets its line), and every radixserve path it names exists.

A module is named by a row of the Files table whose first cell is its path (`engine/loop.py`),
or inside its folder's row (`server/output/` naming `events.py`); a package likewise, by its
own path (`kernels/triton/`) or inside its parent folder's row (`formats/`)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "radixserve"
TOP = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
# a path into the package as the doc spells it: `engine/loop.py`, `tools/`, `radixserve/config.py`
PATH = re.compile(rf"(?<![\w./-])(?:radixserve/)?((?:{'|'.join(TOP)})/(?:[\w]+/)*(?:[\w]+\.py)?)")


def _doc() -> str:
    return (ROOT / "docs" / "architecture.md").read_text()


def _rows(doc: str) -> dict[str, str]:
    """The Files table: the first cell's path -> the whole row."""
    rows = {}
    for line in doc.splitlines():
        match = re.match(r"^\| `([^`]+)` \|", line)
        if match:
            rows[match.group(1)] = line
    return rows


def _modules() -> list[str]:
    """Every module and package, as paths relative to radixserve/ (packages end in /)."""
    paths = [m.relative_to(PACKAGE).as_posix() for m in PACKAGE.rglob("*.py") if m.name != "__init__.py"]
    paths += [i.parent.relative_to(PACKAGE).as_posix() + "/" for i in PACKAGE.rglob("__init__.py")
              if i.parent != PACKAGE]
    return sorted(paths)


def _named(path: str, rows: dict[str, str], doc: str) -> bool:
    if path in rows or (path.endswith("/") and f"`{path}`" in doc):
        return True
    folder, _, name = path.rstrip("/").rpartition("/")
    folder = folder + "/" if folder else ""
    name = name + "/" if path.endswith("/") else name
    return folder in rows and f"`{name}`" in rows[folder]


def test_every_module_and_package_is_named():
    rows, doc = _rows(_doc()), _doc()
    unnamed = [p for p in _modules() if not _named(p, rows, doc)]
    assert not unnamed, f"docs/architecture.md names no row for: {unnamed}"


def test_every_path_it_names_exists():
    doc = _doc()
    named = PATH.findall(doc)
    assert len(named) > 50, "the Files table names too few radixserve paths"
    missing = sorted({p for p in named if not (PACKAGE / p).exists()})
    assert not missing, f"docs/architecture.md names what is not there: {missing}"


def test_every_file_a_folder_row_names_exists():
    missing = []
    for folder, row in _rows(_doc()).items():
        if not folder.endswith("/"):
            continue
        concept = row.split("|", 2)[2]  # past the first cell, the folder itself
        for name in re.findall(r"`([\w]+(?:\.py|/))`", concept):
            if not (PACKAGE / folder / name).exists():
                missing.append(folder + name)
    assert not missing, f"docs/architecture.md's folder rows name what is not there: {missing}"
