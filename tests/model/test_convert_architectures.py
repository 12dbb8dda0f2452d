"""A converted GGUF names its architecture in config.json (a GGUF's own config has none, and
loaders such as NVIDIA Dynamo's model card refuse `"architectures": null`)."""

from __future__ import annotations

import json

from radixserve.model.default_model import _architectures, convert_gguf_metadata, default_gguf_path


def test_a_converted_gguf_names_its_architecture(tmp_path):
    target = convert_gguf_metadata(default_gguf_path(), tmp_path / "smollm2")
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]


def test_each_family_gets_transformers_causal_lm_class():
    assert _architectures("gemma3_text") == ["Gemma3ForCausalLM"]
    assert _architectures("qwen2") == ["Qwen2ForCausalLM"]
    assert _architectures("no-such-type") == []
