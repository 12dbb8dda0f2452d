"""Qwen3-MoE (model/qwen3_moe.py, model/moe.py) on a tiny random-weight config: greedy output
equal to transformers token for token, from a Hugging Face directory and from a GGUF whose
experts are served quantized, through chunked prefill, preemption and a prefix hit."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch

from radixserve import Engine
from tiny_models import run_checked
from tiny_gguf import write_gguf

CHUNK = 16


def tiny_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    values = dict(vocab_size=97, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=3, 
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-6, initializer_range=0.5, tie_word_embeddings=False,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
    values.update(overrides)
    return Qwen3MoeConfig(**values)


def moe_dir(root: Path, mlp_only_layers: list[int]) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(mlp_only_layers=mlp_only_layers), dtype=torch.float32)
    with torch.no_grad():  # a decisive router: no near ties between the k-th and k+1-th expert
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 1.0)
    directory = root / "qwen3-moe"
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    """Layer 1 keeps a dense MLP (mlp_only_layers)."""
    return moe_dir(tmp_path_factory.mktemp("moe"), [1])


@pytest.fixture(scope="module")
def tiny_moe_all_sparse(tmp_path_factory) -> Path:
    """Experts in every layer, as a GGUF's qwen3moe always has them."""
    return moe_dir(tmp_path_factory.mktemp("moe-sparse"), [])


@functools.lru_cache(maxsize=4)
def _hf_model(directory: Path, gguf: str | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    if gguf is None:
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(directory, gguf_file=gguf, moe_intermediate_size=64)
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, config=config,
                                                dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(n)] for n in lengths]


def engine_for(model: str, **options) -> Engine:
    defaults = dict(block_size=4, num_kv_blocks=256, chunked_prefill_size=CHUNK, max_num_batched_tokens=CHUNK)
    return Engine(model, **{**defaults, **options})


def _greedy_through_the_engine(engine: Engine, reference, prompts):
    outs = [out.token_ids for out in run_checked(engine, prompts, 8)]
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(reference, prompt, 8)
    # a follow-up turn: the first prompt and its reply come back from the cache
    follow = prompts[0] + outs[0] + prompts_of([5], seed=9)[0]
    cached_before = engine.stats()["cached_prompt_tokens"]
    assert run_checked(engine, [follow], 6)[0].token_ids == hf_greedy(reference, follow, 6)
    assert engine.stats()["cached_prompt_tokens"] - cached_before >= len(prompts[0]) // 4 * 4


def test_the_family_is_registered_and_its_spec_read(tiny_moe):
    from radixserve.model.hf_config import load_hf_config
    from radixserve.model.registry import family_for_config, family_for_gguf
    from radixserve.model.spec import ModelSpec

    config = load_hf_config(tiny_moe)
    assert family_for_config(config).name == "qwen3_moe" and family_for_gguf("qwen3moe").name == "qwen3_moe"
    spec = ModelSpec.from_hf_config(config)
    assert spec.qk_norm and not spec.qkv_bias and spec.family == "qwen3_moe"


def test_greedy_equals_transformers_from_a_directory(tiny_moe):
    engine = engine_for(str(tiny_moe))
    model = engine.runner.model
    assert model.native is None  # its expert layers run layer by layer
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["SparseMoE", "MLP", "SparseMoE"]
    prompts = prompts_of([5, 3 * CHUNK - 5, 11, 2 * CHUNK + 1], seed=1)  # two longer than a chunk
    _greedy_through_the_engine(engine, _hf_model(tiny_moe), prompts)


def test_preemption_keeps_outputs_equal(tiny_moe):
    engine = engine_for(str(tiny_moe), num_kv_blocks=20, max_num_batched_tokens=24)
    prompts = prompts_of([30, 22, 9, 27, 14, 19], seed=5)
    outs = [out.token_ids for out in run_checked(engine, prompts, 10)]
    reference = _hf_model(tiny_moe)
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(reference, prompt, 10)
    assert engine.stats()["preemptions"] > 0


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_greedy_equals_transformers_from_a_quantized_gguf(tiny_moe_all_sparse, tmp_path, quant):
    """The experts served as the file stores them (8- and 4-bit), one quantized weight per expert;
    the reference is transformers on the same file (dequantized to float32)."""
    from radixserve.model.moe import SparseMoE

    path = write_gguf(tiny_moe_all_sparse, tmp_path / f"tiny-qwen3moe.{quant}.gguf", quant=quant)
    engine = engine_for(str(path))
    moe = engine.runner.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and moe.gate_up is None and moe.down is None
    assert len(moe.quant_gate_up) == 8 and {w.kind for w in moe.quant_gate_up + moe.quant_down} == {quant}
    assert engine.stats()["weight_dtype"] == f"gguf:{quant}"
    assert engine.loaded.spec.hf_config.moe_intermediate_size == 64  # from the header (transformers skips it)
    assert engine.runner.model.native is not None, "decode steps run every layer in one C call"
    prompts = prompts_of([7, 2 * CHUNK + 3, 12], seed=2)
    _greedy_through_the_engine(engine, _hf_model(path.parent, path.name), prompts)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_the_native_decoder_gives_the_layer_paths_logits_bit_for_bit(tiny_moe_all_sparse, tmp_path, quant):
    """Decode steps of an experts model in one C call (model/native_decoder.py: the router's
    logits, then the experts' call) give the layer-by-layer path's logits, bit for bit."""
    path = write_gguf(tiny_moe_all_sparse, tmp_path / f"tiny-qwen3moe.{quant}.gguf", quant=quant)
    fused, layers = engine_for(str(path)), engine_for(str(path))
    layers.runner.model.native = None
    runs = []
    for engine in (fused, layers):
        logits, native = [], []
        model = engine.runner.model
        model.register_forward_hook(lambda module, args, out: logits.append(out.clone()))
        if model.native is not None:
            run = model.native.run
            model.native.run = lambda *a, **k: native.append(run(*a, **k)) or native[-1]
        tokens = [out.token_ids for out in run_checked(engine, prompts_of([9, 3, 2 * CHUNK + 5], seed=4), 12)]
        runs.append((logits, native, tokens))
    (fused_logits, took, fused_tokens), (layer_logits, _, layer_tokens) = runs
    assert fused_tokens == layer_tokens
    assert len(fused_logits) == len(layer_logits) and all(torch.equal(a, b) for a, b in zip(fused_logits, layer_logits))
    assert sum(out is not None for out in took) >= 11, "the decode steps ran natively"


def test_only_the_selected_experts_are_read(tiny_moe):
    """Rows are grouped per expert: each selected expert multiplies once, on its rows only."""
    from radixserve.model.loader import load_model
    from radixserve.model.moe import SparseMoE

    moe = load_model(str(tiny_moe), device="cpu").model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    calls: list[tuple[int, int]] = []
    original = moe.expert
    moe.expert = lambda e, h: calls.append((e, h.shape[0])) or original(e, h)
    x = torch.randn(5, 64)
    out = moe(x)
    _, chosen = torch.topk(torch.softmax(moe.gate(x), dim=-1), 2, dim=-1)
    want = sorted((e, int((chosen == e).sum())) for e in set(chosen.reshape(-1).tolist()))
    assert calls == want  # ascending expert order, each expert once with all its rows
    assert sum(n for _, n in calls) == 5 * 2
    calls.clear()
    moe(x[:1])  # one decode row: exactly its two experts
    assert sorted(e for e, _ in calls) == sorted(chosen[0].tolist()) and all(n == 1 for _, n in calls)
    assert out.shape == x.shape


def test_an_unsupported_architecture_is_refused_naming_qwen3_moe(tmp_path):
    import json
    import time

    from radixserve.model.loader import load_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "dbrx", "architectures": ["DbrxForCausalLM"]}))
    start = time.monotonic()
    with pytest.raises(ValueError, match="unsupported model type 'dbrx'.*qwen3_moe \\(model types qwen3_moe\\)"):
        load_model(str(tmp_path))
    assert time.monotonic() - start < 1.0
