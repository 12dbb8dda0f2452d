"""docs/architecture.md says what the server and the cluster hold: every module of server/ and
cluster/ is named there (a new module gets its line), and every such path it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "cluster")


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


def test_every_module_of_the_server_and_the_cluster_is_named():
    rows = _rows(_doc())
    unnamed = []
    for package in PACKAGES:
        for module in sorted((ROOT / "radixserve" / package).rglob("*.py")):
            path = module.relative_to(ROOT / "radixserve").as_posix()
            folder = path.rsplit("/", 1)[0] + "/"
            if module.name == "__init__.py" or path in rows:
                continue
            if folder in rows and f"`{module.name}`" in rows[folder]:
                continue  # named in its folder's row
            unnamed.append(path)
    assert not unnamed, f"docs/architecture.md names no row for: {unnamed}"


def test_every_server_and_cluster_path_it_names_exists():
    named = re.findall(r"`((?:server|cluster)/[A-Za-z0-9_/]*(?:\.py|/))`", _doc())
    assert named, "the Files table names no server/ or cluster/ path"
    missing = [p for p in named if not (ROOT / "radixserve" / p).exists()]
    assert not missing, f"docs/architecture.md names what is not there: {missing}"
