"""gpt-oss (model/gpt_oss.py) on a tiny random-weight config: attention sinks, q/k/v/o biases,
YaRN RoPE, layers alternating an 8-token window (on the hybrid KV's window pages) and full
attention, and the MoE (biased router, top k then softmax, biased experts, the clamped SwiGLU).
Greedy output equals transformers token for token on prompts longer than the window and than a
prefill chunk, through chunked prefill, preemption and a prefix hit, on the cpu (C kernels) and
torch attention backends, the engine's integrity checked after every step."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import pytest
import torch

from radixserve import Engine
from tiny_models import run_checked

CHUNK = 16
WINDOW = 8


def tiny_gpt_oss_config(**overrides):
    from transformers import GptOssConfig

    values = dict(vocab_size=97, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                  sliding_window=WINDOW, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.5,
                  swiglu_limit=2.0,  # low enough that the clamps bite on these weights
                  rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                       beta_slow=1.0, truncate=False, original_max_position_embeddings=64),
                  tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    values.update(overrides)
    return GptOssConfig(**values)


def save_tiny_gpt_oss(directory: Path, seed: int, **overrides) -> Path:
    """A random tiny gpt-oss saved in `directory`: biases and sinks nonzero, so each is tested,
    and a decisive router."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_gpt_oss_config(**overrides), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2.0)
            layer.mlp.router.weight.normal_(0, 1.0)
            layer.mlp.router.bias.normal_(0, 0.5)
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.5)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.5)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory) -> Path:
    return save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "tiny", seed=11)


@functools.lru_cache(maxsize=2)
def _hf_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def hf_greedy(directory: Path, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = _hf_model(directory).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(n)] for n in lengths]


def engine_for(model: Path, **options) -> Engine:
    defaults = dict(block_size=4, num_kv_blocks=256, chunked_prefill_size=CHUNK, max_num_batched_tokens=CHUNK)
    return Engine(str(model), **{**defaults, **options})


def test_the_spec_reads_sinks_biases_and_alternating_windows(tiny_gpt_oss):
    from radixserve.model.hf_config import load_hf_config
    from radixserve.model.registry import family_for_config
    from radixserve.model.spec import ModelSpec

    config = load_hf_config(tiny_gpt_oss)
    family = family_for_config(config)
    assert family.name == "gpt_oss" and family.chat_template == "harmony" and family.reasoning_parser == "gpt_oss"
    spec = ModelSpec.from_hf_config(config)
    assert spec.attention_sinks and spec.qkv_bias and spec.o_bias and not spec.qk_norm
    assert spec.layer_windows == (WINDOW, 0, WINDOW, 0)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_equals_transformers_through_chunks_and_a_prefix_hit(tiny_gpt_oss, backend):
    engine = engine_for(tiny_gpt_oss, attention_backend=backend)
    model = engine.runner.model
    assert model.native is None and engine.runner.pool.hybrid  # layer by layer; window layers on window pages
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["GptOssMoE"] * 4
    prompts = prompts_of([5, 3 * CHUNK - 5, 11, 2 * CHUNK + 1], seed=1)  # some past the window and a chunk
    outs = [out.token_ids for out in run_checked(engine, prompts, 8)]
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(tiny_gpt_oss, prompt, 8)
    # the next turn: the first long prompt and its reply come back from the cache, to the reply's
    # last whole block (its last token's KV was never computed), whose window the cache kept
    follow = prompts[1] + outs[1] + prompts_of([6], seed=9)[0]
    cached_before = engine.stats()["cached_prompt_tokens"]
    assert run_checked(engine, [follow], 6)[0].token_ids == hf_greedy(tiny_gpt_oss, follow, 6)
    assert engine.stats()["cached_prompt_tokens"] - cached_before == (len(prompts[1]) + 8 - 1) // 4 * 4


def test_preemption_keeps_outputs_equal(tiny_gpt_oss):
    engine = engine_for(tiny_gpt_oss, num_kv_blocks=24, max_num_batched_tokens=24)
    prompts = prompts_of([30, 22, 9, 27, 14, 19], seed=5)
    outs = [out.token_ids for out in run_checked(engine, prompts, 10)]
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(tiny_gpt_oss, prompt, 10)
    assert engine.stats()["preemptions"] > 0


def test_the_moe_routes_top_k_then_softmax_and_clamps_its_swiglu(tiny_gpt_oss):
    """One layer's MoE against transformers' on the same rows, some driven past the clamp."""
    from radixserve.model.loader import load_model

    ours = load_model(str(tiny_gpt_oss), device="cpu").model.layers[1].mlp
    theirs = _hf_model(tiny_gpt_oss).model.layers[1].mlp
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(4)) * torch.tensor([1.0, 4.0] * 3 + [9.0])[:, None]
    with torch.no_grad():
        want, _ = theirs(x[None])
    torch.testing.assert_close(ours(x), want[0], atol=1e-5, rtol=1e-5)


def test_mxfp4_experts_are_refused_clearly(tiny_gpt_oss, tmp_path):
    from safetensors.torch import load_file, save_file

    from radixserve.model.loader import load_model

    tensors = load_file(tiny_gpt_oss / "model.safetensors")
    tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"] = torch.zeros(4, 64, 2, 16, dtype=torch.uint8)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((tiny_gpt_oss / "config.json").read_text())
    with pytest.raises(ValueError, match="MXFP4"):
        load_model(str(tmp_path), device="cpu")
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt_oss"
