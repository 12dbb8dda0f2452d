"""The resolved config kept beside config.json (model/hf_config.py): the same model spec and
RoPE tables as transformers' config object, written once, read back without transformers'
config classes, and thrown away when config.json changes."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from radixserve.model.hf_config import RESOLVED_FILE, ResolvedConfig, load_hf_config
from radixserve.model.layers import _rope_inv_freq
from radixserve.model.spec import ModelSpec
from tiny_models import build_tiny_gemma3_image_text, tiny_config


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
    first = load_hf_config(directory)  # resolved by transformers, written beside config.json
    assert not isinstance(first, ResolvedConfig) and (directory / RESOLVED_FILE).is_file()
    again = load_hf_config(directory)
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
    (directory / RESOLVED_FILE).write_text("{not json")
    assert load_hf_config(directory).num_hidden_layers == 5  # a damaged file is resolved again


def test_a_directory_that_cannot_take_the_file_resolves_every_time(tmp_path):
    directory = _save(tiny_config("llama"), tmp_path / "ro")
    (directory / RESOLVED_FILE).mkdir()  # the name is taken: nothing can be written there (root too)
    assert load_hf_config(directory).num_hidden_layers == 2
    assert not isinstance(load_hf_config(directory), ResolvedConfig)
    assert (directory / RESOLVED_FILE).is_dir() and not list(directory.glob(".radixserve-config-*"))


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
