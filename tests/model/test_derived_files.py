"""model/derived_files.py: what radixserve derives from a model folder lives in its cache, one
entry per folder's resolved path; a value is read back only under the key it was written with
(and from its own folder's entry); entries of folders that are gone are removed when another is
written, those of folders that exist are kept."""

from __future__ import annotations

import shutil

from radixserve.model.derived_files import DERIVED_DIR, entry_dir, read_derived, write_derived

KEY = {"files_sha256": "abc", "transformers": "5.0"}


def test_a_value_is_read_back_under_its_key_and_folder_only(tmp_path):
    cache = str(tmp_path / "cache")
    folder, twin = tmp_path / "model", tmp_path / "twin"
    folder.mkdir()
    twin.mkdir()
    write_derived(folder, "x.json", KEY, {"a": [1, 2]}, cache)
    assert read_derived(folder, "x.json", KEY, cache) == {"a": [1, 2]}
    assert read_derived(tmp_path / "model" / ".." / "model", "x.json", KEY, cache) == {"a": [1, 2]}  # resolved path
    assert read_derived(folder, "x.json", {**KEY, "transformers": "5.1"}, cache) is None
    assert read_derived(folder, "y.json", KEY, cache) is None
    assert read_derived(twin, "x.json", KEY, cache) is None
    assert sorted(p.name for p in folder.iterdir()) == []  # nothing in the folder
    assert entry_dir(folder, cache).parent == tmp_path / "cache" / DERIVED_DIR
    write_derived(folder, "x.json", KEY, {"not json": object()}, cache)  # not kept; the old value stays
    assert read_derived(folder, "x.json", KEY, cache) == {"a": [1, 2]}


def test_entries_of_folders_gone_are_removed_when_another_is_written(tmp_path):
    cache = str(tmp_path / "cache")
    kept, gone, new = (tmp_path / name for name in ("kept", "gone", "new"))
    for folder in (kept, gone, new):
        folder.mkdir()
    write_derived(kept, "x.json", KEY, 1, cache)
    write_derived(gone, "x.json", KEY, 2, cache)
    shutil.rmtree(gone)
    assert entry_dir(gone, cache).is_dir()
    write_derived(new, "x.json", KEY, 3, cache)
    assert not entry_dir(gone, cache).exists()
    assert [read_derived(f, "x.json", KEY, cache) for f in (kept, new)] == [1, 3]
