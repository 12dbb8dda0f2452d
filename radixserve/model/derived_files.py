"""Files derived from a model folder (its resolved config, its resolved tokenizer), kept in
radixserve's cache directory, never in the folder itself: a model folder is the user's (often
read-only, shared, or a hub snapshot whose files are content hashes).

Each folder has one entry, `<cache>/resolved/<folder name>-<hash of its resolved path>/`, so two
folders never share one. A file there is read only under the key it was written with (the
caller's: its sources' bytes and transformers' version; the folder's path is added here), so a
changed source misses and is written again. Files are written whole or not at all; where the
cache cannot be written, nothing is kept and the caller resolves again next time. Entries of
folders that no longer exist (a test's temporary model, a moved checkout) are removed when an
entry is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from radixserve.config import cache_root

DERIVED_DIR = "resolved"
_FOLDER_FILE = "folder"  # the entry's folder, by its resolved path


def entry_dir(folder: Path, cache_dir: str | None = None) -> Path:
    """The folder's entry in the cache (not created here)."""
    resolved = Path(folder).resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    return cache_root(cache_dir) / DERIVED_DIR / f"{resolved.name}-{digest}"


def read_derived(folder: Path, name: str, key: dict[str, str], cache_dir: str | None = None) -> Any | None:
    """The value written as `name` for `folder` under `key`, or None (absent, damaged, or
    written under another key)."""
    try:
        data = json.loads((entry_dir(folder, cache_dir) / name).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != _full_key(folder, key) or "value" not in data:
        return None
    return data["value"]


def write_derived(folder: Path, name: str, key: dict[str, str], value: Any, cache_dir: str | None = None,
                  sort_keys: bool = False) -> None:
    """Keep `value` (JSON) as `name` for `folder` under `key`; skipped where it cannot be
    written (a value JSON cannot hold, a cache that is not writable)."""
    try:
        text = json.dumps({"key": _full_key(folder, key), "value": value}, sort_keys=sort_keys)
    except (TypeError, ValueError):
        return
    entry = entry_dir(folder, cache_dir)
    try:
        if not (entry / _FOLDER_FILE).is_file():
            _prune(entry.parent)
            entry.mkdir(parents=True, exist_ok=True)
            _write_whole(entry / _FOLDER_FILE, str(Path(folder).resolve()))
        _write_whole(entry / name, text)
    except OSError:
        return


def _write_whole(file: Path, text: str) -> None:
    """A temporary file beside `file`, renamed over it: readers see the old text or the new."""
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, file)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _full_key(folder: Path, key: dict[str, str]) -> dict[str, str]:
    return {**key, "folder": str(Path(folder).resolve())}


def _prune(root: Path) -> None:
    """Remove the entries whose folder is gone."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return
    for entry in entries:
        try:
            folder = (entry / _FOLDER_FILE).read_text()
        except OSError:
            continue  # being written, or not an entry
        if folder and not Path(folder).exists():
            shutil.rmtree(entry, ignore_errors=True)
