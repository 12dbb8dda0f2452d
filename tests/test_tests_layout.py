"""tests/ mirrors the package: each folder of tests is named for a subpackage of radixserve/ (or is
one of the few that are not: the real model end to end, the benchmarks' code, the chat templates),
and test file names are unique across the folders (pytest imports them by their base name, the
folders having no __init__.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "radixserve"
NOT_A_SUBPACKAGE = {"real_model", "bench", "templates"}


def test_every_folder_is_named_for_a_subpackage():
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders - subpackages <= NOT_A_SUBPACKAGE, sorted(folders - subpackages - NOT_A_SUBPACKAGE)


def test_test_file_names_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [name for name, count in names.items() if count > 1]
