"""Qwen3.5-MoE (model/qwen3_5_moe.py: Qwen3.5's Gated DeltaNet and gated attention layers, a
mixture of experts with a sigmoid-gated shared expert in every layer) on a tiny random-weight
config: greedy output equal to transformers token for token through chunked prefill, preemption
and a prefix hit on the kept DeltaNet states."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from radixserve import Engine
from tiny_models import hf_greedy, run_checked

CHUNK = 16


def tiny_qwen3_5_moe_config(**overrides):
    from transformers import Qwen3_5MoeTextConfig

    values = dict(vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4, moe_intermediate_size=64,
                  shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.5, tie_word_embeddings=False,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)  # layers: linear x 3, full
    values.update(overrides)
    return Qwen3_5MoeTextConfig(**values)


def build_tiny_qwen3_5_moe(directory: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_5_moe_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # a decisive router: no near ties at the k-th expert
                param.normal_(0, 1.0)
            elif name.endswith(("norm.weight", "dt_bias", "shared_expert_gate.weight")):  # (1 + w) norms, tiled heads
                param.normal_(0, 0.3)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    return build_tiny_qwen3_5_moe(tmp_path_factory.mktemp("qwen3_5_moe"))


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(n)] for n in lengths]


def engine_for(model, **options) -> Engine:
    defaults = dict(block_size=4, num_kv_blocks=256, chunked_prefill_size=CHUNK, max_num_batched_tokens=CHUNK)
    return Engine(str(model), **{**defaults, **options})


def test_the_family_is_registered_and_its_layers_built(tiny_moe):
    from radixserve.model.moe import SparseMoE
    from radixserve.model.registry import family_for_config, family_for_gguf

    engine = engine_for(tiny_moe)
    spec = engine.loaded.spec
    assert spec.family == "qwen3_5_moe" and family_for_gguf("qwen35moe").name == "qwen3_5_moe"
    assert family_for_config(spec.hf_config).name == "qwen3_5_moe"
    assert spec.recurrent_layers == (0, 1, 2) and spec.intermediate_size == 96
    moe = engine.runner.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and moe.shared_expert is not None and moe.num_experts == 8
    assert moe.shared_expert.gate_up_proj.weight.shape == (2 * 96, 64)


def test_greedy_equals_transformers_chunked_with_a_prefix_hit(tiny_moe):
    engine = engine_for(tiny_moe)
    prompts = prompts_of([5, 3 * CHUNK - 5, 11, 2 * CHUNK + 1], seed=1)  # two longer than a chunk
    outs = [out.token_ids for out in run_checked(engine, prompts, 8)]
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(tiny_moe, prompt, 8)
    follow = prompts[1] + outs[1] + prompts_of([5], seed=9)[0]  # the next turn: resumes at the reply's end
    (second,) = run_checked(engine, [follow], 6)
    assert second.cached_tokens == (len(prompts[1]) + 8 - 1) // 4 * 4  # the last block end of its reply
    assert second.token_ids == hf_greedy(tiny_moe, follow, 6)
    assert engine.stats()["recurrent_snapshot_restores"] >= 1


def test_preemption_keeps_outputs_equal(tiny_moe):
    engine = engine_for(tiny_moe, num_kv_blocks=20, max_num_batched_tokens=24)
    prompts = prompts_of([30, 22, 9, 27, 14, 19], seed=5)
    outs = [out.token_ids for out in run_checked(engine, prompts, 10)]
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(tiny_moe, prompt, 10)
    assert engine.stats()["preemptions"] > 0


def test_the_shared_expert_is_gated_per_row():
    """SparseMoE with a shared expert: the routed sum plus sigmoid(gate(x)) * shared(x), against
    the same sum computed by hand from its parts."""
    from types import SimpleNamespace

    from radixserve.model.llama import MLP
    from radixserve.model.moe import SparseMoE

    torch.manual_seed(0)
    spec = SimpleNamespace(hidden_size=16, intermediate_size=24, mlp_bias=False)
    moe = SparseMoE(16, 8, 4, 2, True, shared_expert=MLP(spec))
    for p in moe.parameters():
        p.data.normal_(0, 0.5)
    moe.gate_up.normal_(0, 0.5)
    moe.down.normal_(0, 0.5)
    x = torch.randn(5, 16)
    gate, up = (x @ moe.shared_expert.gate_up_proj.weight.t()).split(24, dim=-1)
    shared = (torch.nn.functional.silu(gate) * up) @ moe.shared_expert.down_proj.weight.t()
    want = moe.forward_per_expert(x, moe.gate(x)) + torch.sigmoid(x @ moe.shared_expert_gate.weight.t()) * shared
    torch.testing.assert_close(moe(x), want)
