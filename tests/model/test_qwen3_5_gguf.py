"""Qwen3.5 dense and MoE from GGUF files laid out as llama.cpp's converter writes qwen35 /
qwen35moe (tests/tiny_gguf.py: norms 1 + w, A = -exp(A_log) as ssm_a, dt_bias as ssm_dt.bias,
the conv squeezed, value heads tiled, q_proj with its per-head gate rows, experts stacked, the
shared expert and its gate): the config read from the header (transformers reads no such file),
greedy equal to transformers token for token through chunked prefill and a prefix hit on the
kept DeltaNet states; a quantized file served as stored, against transformers on the values it
holds."""

from __future__ import annotations

import pytest

from radixserve import Engine
from tiny_gguf import quant_rounded, write_gguf
from tiny_models import resumed_turns
from test_qwen3_5_moe import build_tiny_qwen3_5_moe


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return build_tiny_qwen3_5_moe(tmp_path_factory.mktemp("qwen3_5_moe_gguf"))


def engine_for(path):
    return Engine(str(path), block_size=4, num_kv_blocks=128, chunked_prefill_size=16, max_num_batched_tokens=32)


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_a_qwen35_gguf_is_greedy_equal_to_transformers(tiny_model_dir, tmp_path, quant):
    directory = tiny_model_dir("qwen3_5")
    path = write_gguf(directory, tmp_path / f"tiny-qwen35.{quant}.gguf", quant=quant)
    engine = engine_for(path)
    spec = engine.loaded.spec
    assert spec.family == "qwen3_5" and spec.recurrent_layers == (0, 1, 2)
    assert spec.hf_config.linear_num_value_heads == 4 and spec.hf_config.rope_parameters["partial_rotary_factor"] == 0.25
    attention = engine.runner.model.layers[3].self_attn
    if quant == "Q8_0":
        assert engine.stats()["weight_dtype"] == "gguf:Q8_0"
        assert attention.qkv_proj.quant.kind == "Q8_0" and attention.output_gate.quant.kind == "Q8_0"
        reference = quant_rounded(directory, tmp_path / "rounded", quant)
    else:
        reference = directory
    resumed_turns(engine, reference)


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_a_qwen35moe_gguf_is_greedy_equal_to_transformers(tiny_moe, tmp_path, quant):
    """The Q8_0 file also carries a multi-token-prediction block (blk.4, nextn_predict_layers 1),
    which is left out."""
    from radixserve.model.moe import SparseMoE

    path = write_gguf(tiny_moe, tmp_path / f"tiny-qwen35moe.{quant}.gguf", quant=quant, mtp=quant == "Q8_0")
    engine = engine_for(path)
    assert engine.loaded.spec.family == "qwen3_5_moe" and engine.loaded.spec.num_layers == 4
    moe = engine.runner.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and moe.shared_expert is not None
    if quant == "Q8_0":
        assert moe.gate_up is None and {w.kind for w in moe.quant_gate_up + moe.quant_down} == {"Q8_0"}
        assert moe.shared_expert.gate_up_proj.quant.kind == "Q8_0"
        reference = quant_rounded(tiny_moe, tmp_path / "rounded", quant)
    else:
        reference = tiny_moe
    resumed_turns(engine, reference)


def test_float_weights_from_a_qwen35_gguf_are_refused_clearly(tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir("qwen3_5"), tmp_path / "tiny-qwen35.gguf", quant="Q8_0")
    with pytest.raises(ValueError, match="'qwen35' GGUF is served with its weights as the file stores them"):
        Engine(str(path), weight_dtype="float32")


@pytest.mark.parametrize("arch", ["qwen35", "granitehybrid"])
def test_a_header_with_scaled_rope_is_refused_not_read_as_plain(arch):
    """The header readers know plain RoPE only: a file declaring YaRN would otherwise be served
    with unscaled positions."""
    from types import SimpleNamespace

    from radixserve.model.granite_hybrid import granite_gguf_config
    from radixserve.model.qwen3_5 import qwen3_5_gguf_config

    read = (lambda h: qwen3_5_gguf_config(h, "qwen3_5_text")) if arch == "qwen35" else granite_gguf_config
    header = SimpleNamespace(architecture=arch, tensors=[], metadata={
        f"{arch}.rope.scaling.type": "yarn", f"{arch}.rope.scaling.factor": 4.0})
    with pytest.raises(ValueError, match=f"this {arch} GGUF scales RoPE .*'yarn', factor 4"):
        read(header)
    header.metadata[f"{arch}.rope.scaling.factor"] = 1.0  # declared but a factor of 1: plain, read on
    with pytest.raises(ValueError, match="header lacks"):
        read(header)
