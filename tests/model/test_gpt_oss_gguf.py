"""gpt-oss from a GGUF laid out as llama.cpp's converter writes `gpt-oss` (tests/tiny_gguf.py:
attn_sinks, post_attention_norm, the router with its bias as ffn_gate_inp, the experts split
into gate, up and down with their biases, YaRN and the window in the header), its experts
MXFP4 as OpenAI ships them: the config read from the header, greedy equal to transformers token
for token (on the values the file holds) on prompts past the 8-token window and a prefill
chunk, through chunked prefill, preemption and a prefix hit; a header radixserve does not read is refused
in well under a second, naming what runs."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from radixserve import Engine
from test_gpt_oss import CHUNK, WINDOW, hf_greedy, prompts_of, save_tiny_gpt_oss
from tiny_gguf import write_gguf
from tiny_models import run_checked


@pytest.fixture(scope="module")
def tiny_gpt_oss_64(tmp_path_factory) -> Path:
    """Experts 64 wide (the quantized kernels' rows are 64-multiples), gpt-oss's own clamp (7.0:
    a header has no field for it), biases, sinks and router drawn large enough that it bites."""
    return save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss-gguf") / "tiny", seed=12, intermediate_size=64,
                             swiglu_limit=7.0)


def _round(t: torch.Tensor, kind: str) -> torch.Tensor:
    """t's rows through a GGUF type and back, as the file holds them."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    data = t.float().numpy()
    return torch.from_numpy(np.asarray(quants.dequantize(quants.quantize(data, qtype), qtype)).reshape(data.shape))


def rounded_reference(directory: Path, out: Path, quant: str) -> Path:
    """The transformers checkpoint holding the values the GGUF holds: the experts MXFP4 along
    their input features (gate_up_proj is [E, H, 2I], x @ w), the other 64-wide matrices but the
    router `quant` along their rows."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(directory, out)
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = _round(t.transpose(1, 2), "MXFP4").transpose(1, 2).contiguous()
        elif quant != "F32" and t.dim() == 2 and t.shape[1] % 64 == 0 and "router" not in name:
            tensors[name] = _round(t, quant)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("quant", ["Q8_0"])  # F32 beside MXFP4: the preemption test below
def test_a_gpt_oss_gguf_with_mxfp4_experts_is_greedy_equal_to_transformers(tiny_gpt_oss_64, tmp_path, quant):
    from radixserve.model.gpt_oss import GptOssMoE

    path = write_gguf(tiny_gpt_oss_64, tmp_path / f"tiny-gpt-oss.{quant}.gguf", quant=quant, expert_quant="MXFP4")
    engine = Engine(str(path), block_size=4, num_kv_blocks=256, chunked_prefill_size=CHUNK,
                    max_num_batched_tokens=CHUNK)
    spec = engine.loaded.spec
    assert spec.family == "gpt_oss" and spec.attention_sinks and spec.qkv_bias and spec.o_bias
    assert spec.layer_windows == (WINDOW, 0, WINDOW, 0) and spec.head_dim == 16
    rope = spec.hf_config.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"], rope["truncate"]) == (
        "yarn", 4.0, 64, False)
    model = engine.runner.model
    moe = model.layers[1].mlp
    assert isinstance(moe, GptOssMoE) and moe.gate_up is None and moe.native is None  # an expert at a time
    assert {w.kind for w in moe.quant_gate_up + moe.quant_down} == {"MXFP4"}
    assert moe.quant_gate_up[0].bits == 8 and moe.quant_gate_up[0].zero == 128
    assert engine.stats()["weight_dtype"] == "gguf:MXFP4+Q8_0"
    assert model.layers[0].self_attn.qkv_proj.quant.kind == "Q8_0"
    reference = rounded_reference(tiny_gpt_oss_64, tmp_path / "rounded", quant)
    prompts = prompts_of([5, 3 * CHUNK - 5, 11, 2 * CHUNK + 1], seed=1)  # past the window and a chunk
    outs = [out.token_ids for out in run_checked(engine, prompts, 8)]
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(reference, prompt, 8)
    follow = prompts[1] + outs[1] + prompts_of([6], seed=9)[0]
    cached_before = engine.stats()["cached_prompt_tokens"]
    assert run_checked(engine, [follow], 6)[0].token_ids == hf_greedy(reference, follow, 6)
    assert engine.stats()["cached_prompt_tokens"] - cached_before == (len(prompts[1]) + 8 - 1) // 4 * 4


def test_preemption_keeps_a_gguf_s_outputs_equal(tiny_gpt_oss_64, tmp_path):
    """A file whose other tensors are F32 beside the MXFP4 experts, under preemption."""
    path = write_gguf(tiny_gpt_oss_64, tmp_path / "tiny-gpt-oss.gguf", quant="F32", expert_quant="MXFP4")
    engine = Engine(str(path), block_size=4, num_kv_blocks=20, chunked_prefill_size=CHUNK, max_num_batched_tokens=24)
    assert engine.stats()["weight_dtype"] == "gguf:MXFP4"
    reference = rounded_reference(tiny_gpt_oss_64, tmp_path / "rounded", "F32")
    prompts = prompts_of([30, 22, 27, 19], seed=5)
    outs = [out.token_ids for out in run_checked(engine, prompts, 10)]
    assert engine.stats()["preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(reference, prompt, 10)


def test_the_gguf_experts_dequantize_to_the_files_values(tiny_gpt_oss_64, tmp_path):
    """Each expert's repacked weight is, bit for bit, gguf.quants' dequantization of the file's
    MXFP4 tensor (gate and up split from transformers' interleaved gate_up_proj)."""
    from gguf import GGMLQuantizationType, GGUFReader, quants

    from radixserve.model.loader import load_model

    path = write_gguf(tiny_gpt_oss_64, tmp_path / "tiny-gpt-oss.gguf", quant="Q8_0", expert_quant="MXFP4")
    moe = load_model(str(path), device="cpu").model.layers[2].mlp
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    for stem, held, rows in (("ffn_gate_exps", moe.quant_gate_up, slice(0, 64)),
                             ("ffn_up_exps", moe.quant_gate_up, slice(64, 128)),
                             ("ffn_down_exps", moe.quant_down, slice(None))):
        t = tensors[f"blk.2.{stem}.weight"]
        assert t.tensor_type == GGMLQuantizationType.MXFP4
        want = torch.from_numpy(np.asarray(quants.dequantize(t.data, t.tensor_type))).reshape(4, 64, 64)
        for e in range(4):
            assert torch.equal(held[e].dequantize()[rows], want[e]), (stem, e)


@pytest.mark.parametrize("extra, message", [
    ({"rope.scaling.yarn_attn_factor": 0.5}, "gpt-oss.rope.scaling.yarn_attn_factor 0.5, which radixserve does not "
                                             "read; it runs gpt-oss's YaRN"),
    ({"attention.sliding_window_pattern": 3}, "sliding_window_pattern 3; radixserve runs gpt-oss's alternation"),
])
def test_a_gpt_oss_gguf_it_does_not_read_is_refused_fast(tiny_gpt_oss_64, tmp_path, monkeypatch, extra, message):
    import tiny_gguf

    written = tiny_gguf._metadata

    def with_extra(writer, arch, config, extra_blocks=0):
        written(writer, arch, config, extra_blocks)
        for key, value in extra.items():
            (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{key}", value)

    monkeypatch.setattr(tiny_gguf, "_metadata", with_extra)
    path = write_gguf(tiny_gpt_oss_64, tmp_path / "variant.gguf", quant="Q8_0", expert_quant="MXFP4")
    start = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        Engine(str(path), model_cache_dir=str(tmp_path / "cache"))
    assert time.perf_counter() - start < 1.0
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


@pytest.mark.parametrize("scaling, message", [
    ({"type": "linear", "factor": 4.0}, r"scales RoPE \(gpt-oss.rope.scaling.type 'linear', factor 4\)"),
    ({"type": "yarn", "factor": 4.0}, "YaRN without gpt-oss.rope.scaling.original_context_length"),
])
def test_rope_scaling_other_than_gpt_oss_yarn_is_refused(scaling, message):
    from types import SimpleNamespace

    from radixserve.model.gpt_oss import gpt_oss_gguf_config

    meta = {f"gpt-oss.rope.scaling.{k}": v for k, v in scaling.items()}
    with pytest.raises(ValueError, match=message):
        gpt_oss_gguf_config(SimpleNamespace(architecture="gpt-oss", tensors=[], metadata={
            "gpt-oss.block_count": 2, **meta}))


def test_gpt_oss_20b_s_header_reads_as_its_transformers_config():
    """The fields llama.cpp's converter writes for gpt-oss-20b read as its published config (24
    layers, 32 experts; the rest transformers' GptOssConfig defaults), YaRN included."""
    from types import SimpleNamespace

    from transformers import GptOssConfig

    from radixserve.model.gpt_oss import gpt_oss_gguf_config
    from radixserve.model.gguf_file import TensorInfo

    a = "gpt-oss"
    meta = {f"{a}.context_length": 131072, f"{a}.embedding_length": 2880, f"{a}.block_count": 24,
            f"{a}.feed_forward_length": 2880, f"{a}.attention.head_count": 64, f"{a}.attention.head_count_kv": 8,
            f"{a}.attention.key_length": 64, f"{a}.attention.value_length": 64,
            f"{a}.attention.layer_norm_rms_epsilon": 1e-5, f"{a}.rope.freq_base": 150000.0,
            f"{a}.attention.sliding_window": 128, f"{a}.expert_count": 32, f"{a}.expert_used_count": 4,
            f"{a}.expert_feed_forward_length": 2880, f"{a}.rope.scaling.type": "yarn",
            f"{a}.rope.scaling.factor": 32.0, f"{a}.rope.scaling.original_context_length": 4096}
    tensors = [TensorInfo("token_embd.weight", [2880, 201088], 8, 0), TensorInfo("output.weight", [2880, 201088], 8, 0),
               TensorInfo("blk.0.attn_q.bias", [4096], 0, 0)]
    ours = GptOssConfig(**gpt_oss_gguf_config(SimpleNamespace(architecture=a, tensors=tensors, metadata=meta)))
    theirs = GptOssConfig(num_hidden_layers=24, num_local_experts=32)
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "num_local_experts", "num_experts_per_tok", "sliding_window",
                  "layer_types", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "swiglu_limit",
                  "attention_bias", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
