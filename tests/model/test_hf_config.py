"""The resolved config kept in radixserve's cache (model/hf_config.py, model/derived_files.py):
the same model spec and RoPE tables as transformers' config object, written once, read back
without transformers' config classes, and thrown away when config.json changes; nothing is
written into the model's directory (a read-only one works), and a stale radixserve-config.json
that an older version left there is ignored and kept."""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from radixserve.model.derived_files import entry_dir
from radixserve.model.hf_config import RESOLVED_FILE, ResolvedConfig, _transformers_version, load_hf_config
from radixserve.model.layers import _rope_inv_freq
from radixserve.model.spec import ModelSpec
from tiny_models import build_tiny_gemma3_image_text, tiny_config


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test's cache (radixserve's, where the resolved config is kept) of its own."""
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))


def _save(config, directory):
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    return directory


def _spec_fields(spec: ModelSpec) -> dict:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "hf_config"}


def _rope_tables(spec: ModelSpec) -> list[tuple[torch.Tensor, float]]:
    kinds = set(spec.hf_config.rope_parameters) if "full_attention" in (spec.hf_config.rope_parameters or {}) else {None}
    return [_rope_inv_freq(spec, kind) for kind in sorted(kinds, key=str)]


CONFIGS = {
    "llama": lambda: tiny_config("llama"),
    "mistral_window": lambda: tiny_config("mistral_window"),
    "qwen2": lambda: tiny_config("qwen2"),
    "qwen3": lambda: tiny_config("qwen3"),
    "gemma3": lambda: tiny_config("gemma3"),
    "gemma3_scaled_full_layers": lambda: tiny_config(
        "gemma3", rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "llama3_rope": lambda: tiny_config(
        "llama", rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 32, "rope_theta": 5e5}),
}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_resolved_config_gives_the_spec_and_rope_of_transformers_config(tmp_path, kind):
    directory = _save(CONFIGS[kind](), tmp_path / kind)
    files = sorted(directory.iterdir())
    first = load_hf_config(directory)  # resolved by transformers, kept in the cache
    assert not isinstance(first, ResolvedConfig) and (entry_dir(directory) / RESOLVED_FILE).is_file()
    again = load_hf_config(directory)
    assert sorted(directory.iterdir()) == files  # nothing written into the model's directory
    assert isinstance(again, ResolvedConfig)
    spec, spec_again = ModelSpec.from_hf_config(first), ModelSpec.from_hf_config(again)
    assert _spec_fields(spec_again) == _spec_fields(spec)
    for (inv, scale), (inv_again, scale_again) in zip(_rope_tables(spec), _rope_tables(spec_again), strict=True):
        assert scale_again == scale
        assert torch.equal(inv_again, inv)


def test_an_image_text_model_reads_its_text_tower_from_the_resolved_config(tmp_path):
    directory = build_tiny_gemma3_image_text(tmp_path / "mm")
    spec = ModelSpec.from_hf_config(load_hf_config(directory))
    spec_again = ModelSpec.from_hf_config(load_hf_config(directory))
    assert isinstance(spec_again.hf_config, ResolvedConfig)
    assert _spec_fields(spec_again) == _spec_fields(spec)
    assert spec_again.layer_windows == (6, 6, 0)


def test_the_resolved_config_follows_config_json(tmp_path):
    directory = _save(tiny_config("llama"), tmp_path / "m")
    load_hf_config(directory)
    config = json.loads((directory / "config.json").read_text())
    config["num_hidden_layers"] = 5
    (directory / "config.json").write_text(json.dumps(config))
    assert load_hf_config(directory).num_hidden_layers == 5  # resolved again, not the stale file
    assert load_hf_config(directory).num_hidden_layers == 5
    (entry_dir(directory) / RESOLVED_FILE).write_text("{not json")
    assert load_hf_config(directory).num_hidden_layers == 5  # a damaged file is resolved again
    assert isinstance(load_hf_config(directory), ResolvedConfig)


def test_a_cache_that_cannot_take_the_file_resolves_every_time(tmp_path):
    directory = _save(tiny_config("llama"), tmp_path / "m")
    (entry_dir(directory) / RESOLVED_FILE).mkdir(parents=True)  # the name is taken: nothing can be written (root too)
    assert load_hf_config(directory).num_hidden_layers == 2
    assert not isinstance(load_hf_config(directory), ResolvedConfig)
    assert sorted(p.name for p in entry_dir(directory).iterdir()) == ["folder", RESOLVED_FILE]  # no temporary left


def test_a_read_only_directory_is_resolved_once_and_left_as_it_was(tmp_path):
    directory = _save(tiny_config("llama"), tmp_path / "ro")
    files = {p.name: p.read_bytes() for p in directory.iterdir()}
    directory.chmod(0o555)
    try:
        assert not isinstance(load_hf_config(directory), ResolvedConfig)
        again = load_hf_config(directory)
        assert isinstance(again, ResolvedConfig) and again.num_hidden_layers == 2
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == files
    finally:
        directory.chmod(0o755)


def test_a_stale_file_an_older_version_left_in_the_directory_is_ignored_and_kept(tmp_path):
    directory = _save(tiny_config("llama"), tmp_path / "old")
    key = {"config_sha256": hashlib.sha256((directory / "config.json").read_bytes()).hexdigest(),
           "transformers": _transformers_version()}
    config = {**json.loads((directory / "config.json").read_text()), "num_hidden_layers": 7}
    stale = json.dumps({"key": key, "config": config})  # as older versions wrote it, under today's key
    (directory / "radixserve-config.json").write_text(stale)
    assert load_hf_config(directory).num_hidden_layers == 2
    assert load_hf_config(directory).num_hidden_layers == 2
    assert (directory / "radixserve-config.json").read_text() == stale


def test_two_directories_of_one_config_keep_entries_of_their_own(tmp_path):
    one, two = _save(tiny_config("llama"), tmp_path / "one"), _save(tiny_config("llama"), tmp_path / "two")
    load_hf_config(one)
    assert entry_dir(one) != entry_dir(two) and not entry_dir(two).exists()
    assert not isinstance(load_hf_config(two), ResolvedConfig)  # not read from the other's entry
    assert isinstance(load_hf_config(two), ResolvedConfig) and isinstance(load_hf_config(one), ResolvedConfig)


def test_loading_from_the_resolved_config_imports_no_transformers_config_class(tmp_path):
    """What the file is for: a serving process reads it without transformers' config classes
    (whose import pulls torch.distributed and sympy in)."""
    directory = _save(tiny_config("gemma3"), tmp_path / "g")
    load_hf_config(directory)
    code = (
        "import sys; from radixserve.model.hf_config import load_hf_config, ResolvedConfig; "
        "from radixserve.model.spec import ModelSpec; from pathlib import Path; "
        f"c = load_hf_config(Path({str(directory)!r})); ModelSpec.from_hf_config(c); "
        "assert isinstance(c, ResolvedConfig); "
        "bad = sorted(m for m in sys.modules if m.startswith(('sympy', 'transformers.models'))); "
        "assert not bad, bad[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.getcwd())
