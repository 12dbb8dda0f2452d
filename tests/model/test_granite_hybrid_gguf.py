"""Granite 4.0-H from GGUF files laid out as llama.cpp's converter writes granitehybrid
(tests/tiny_gguf.py: A = -exp(A_log) and D as [H, 1], dt_bias as ssm_dt.bias, the gated norm as
[groups, inner / groups], the conv squeezed, experts and the shared MLP split into gate and up,
the multipliers as *_scale, RoPE flagged by rope.scaling.finetuned): the config read from the
header (transformers reads no such file), greedy equal to transformers token for token through
chunked prefill and a prefix hit on the kept Mamba2 states; a quantized file served as stored,
against transformers on the values it holds."""

from __future__ import annotations

import pytest

from radixserve import Engine
from tiny_gguf import quant_rounded, write_gguf
from tiny_models import resumed_turns


@pytest.mark.parametrize("kind, quant", [("granite_hybrid", "F32"), ("granite_hybrid", "Q8_0"),
                                         ("granite_hybrid_rope", "Q8_0")])
def test_a_granitehybrid_gguf_is_greedy_equal_to_transformers(tiny_model_dir, tmp_path, kind, quant):
    directory = tiny_model_dir(kind)
    path = write_gguf(directory, tmp_path / f"tiny-{kind}.{quant}.gguf", quant=quant)
    engine = Engine(str(path), block_size=4, num_kv_blocks=128, chunked_prefill_size=16, max_num_batched_tokens=32)
    spec = engine.loaded.spec
    assert spec.family == "granitemoehybrid" and spec.recurrent_layers == (0, 1, 3)
    config = spec.hf_config
    assert config.position_embedding_type == ("rope" if kind == "granite_hybrid_rope" else "nope")
    assert config.logits_scaling == 2.0 and config.mamba_n_heads == 8
    layers = engine.runner.model.layers
    if quant == "Q8_0":
        assert engine.stats()["weight_dtype"] == "gguf:Q8_0"
        assert layers[0].mamba.in_proj.quant.kind == "Q8_0" and layers[2].self_attn.qkv_proj.quant.kind == "Q8_0"
        assert layers[0].shared_mlp.gate_up_proj.quant.kind == "Q8_0"
        if kind == "granite_hybrid":  # gate/up rows quantized (64 columns), down float (32: no Q8_0 rows)
            assert layers[0].mlp.quant_gate_up is None and layers[0].mlp.gate_up is not None
        reference = quant_rounded(directory, tmp_path / "rounded", quant)
    else:
        reference = directory
    resumed_turns(engine, reference)
