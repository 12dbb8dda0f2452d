"""Tiny random Llama-family checkpoints that tests build for themselves (no hub access)."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import torch

TINY_COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    # A wide init makes the logits decisive, so greedy argmax is never a near tie.
    initializer_range=0.5,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def tiny_config(kind: str, **overrides):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    values = dict(TINY_COMMON)
    if kind == "llama":
        cls = LlamaConfig
        values.update(tie_word_embeddings=False)
    elif kind == "mistral":
        cls = MistralConfig
        values.update(sliding_window=None, tie_word_embeddings=False)
    elif kind == "qwen2":
        cls = Qwen2Config
        values.update(tie_word_embeddings=True, use_sliding_window=False)
    elif kind == "qwen3":
        cls = Qwen3Config
        values.update(head_dim=16, tie_word_embeddings=True, use_sliding_window=False)
    elif kind == "mistral_window":  # every layer attends to the last 6 tokens
        cls = MistralConfig
        values.update(sliding_window=6, tie_word_embeddings=False)
    elif kind == "gemma3":  # two window layers (6 tokens: under a block of 8, across blocks of 4), then a full one
        cls = Gemma3TextConfig
        values.update(head_dim=16, tie_word_embeddings=False, sliding_window=6, query_pre_attn_scalar=24,
                      layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_hidden_layers=3)
    elif kind in ("lfm2", "lfm2_bias"):  # short convolutions beside one full-attention layer
        from transformers import Lfm2Config

        cls = Lfm2Config
        values.update(num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3,
                      norm_eps=values.pop("rms_norm_eps"), block_multiple_of=32)  # MLP width: 85 -> 96
        if kind == "lfm2_bias":  # conv biases, an untied head, the MLP width as given
            values.update(conv_bias=True, tie_word_embeddings=False, block_auto_adjust_ff_dim=False)
    elif kind == "qwen3_5":  # Gated DeltaNet layers, then one gated full-attention layer (partial RoPE)
        from transformers import Qwen3_5TextConfig

        cls = Qwen3_5TextConfig
        values.update(num_hidden_layers=4, head_dim=16, tie_word_embeddings=False, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                      linear_conv_kernel_dim=4)  # layers: linear x 3, full (full_attention_interval 4)
    elif kind in ("granite_hybrid", "granite_hybrid_rope"):  # Mamba2 layers beside one attention layer, experts
        from transformers import GraniteMoeHybridConfig

        cls = GraniteMoeHybridConfig
        values.update(num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"], intermediate_size=32,
                      shared_intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8,
                      mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
                      embedding_multiplier=4.0, attention_multiplier=0.1, residual_multiplier=0.5,
                      logits_scaling=2.0, position_embedding_type=None, tie_word_embeddings=False)
        if kind == "granite_hybrid_rope":  # RoPE, tied, no experts (a dense shared MLP only), one group
            values.update(position_embedding_type="rope", tie_word_embeddings=True, num_local_experts=0,
                          mamba_n_groups=1, mamba_proj_bias=True)
    else:
        raise ValueError(kind)
    values.update(overrides)
    return cls(**values)


def build_tiny_gemma3_image_text(directory: Path, seed: int = 0) -> Path:
    """A tiny Gemma3ForConditionalGeneration (a vision tower beside the text one), saved."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    torch.manual_seed(seed)
    text = tiny_config("gemma3", vocab_size=300)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=299, boi_token_index=297, eoi_token_index=298, tie_word_embeddings=False)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                param.normal_(0, 0.3)
    model.save_pretrained(directory)
    return directory


def build_tiny_model(kind: str, directory: Path, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised model of `kind` as config.json + model.safetensors."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(kind, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind == "qwen2":  # qwen2 has q/k/v biases; make them nonzero so they are tested
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if kind == "lfm2_bias":  # nonzero conv biases, so they are tested
        with torch.no_grad():
            for layer in model.model.layers:
                if hasattr(layer, "conv"):
                    layer.conv.conv.bias.normal_(0, 0.5)
    if kind == "qwen3_5":  # norms multiply by (1 + weight), zero at init: make them nonzero so the offset is tested
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0, 0.3)
    if kind.startswith("granite_hybrid"):  # Mamba2's A_log, D, dt_bias and gated norm start constant: vary them
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("A_log", "dt_bias", "mamba.D", "mamba.norm.weight", "in_proj.bias", "out_proj.bias")):
                    param.normal_(0, 0.5)
    if kind == "gemma3":  # norms multiply by (1 + weight): make weight nonzero so the offset is tested
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0, 0.3)
    model.save_pretrained(directory)
    return directory


@functools.lru_cache(maxsize=8)
def hf_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def hf_greedy(directory: Path, prompt: list[int], max_new_tokens: int, **generate_options) -> list[int]:
    """transformers' own greedy continuation (new tokens only), never stopping early."""
    model = hf_model(directory)
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        **generate_options,
    )
    return out[0, len(prompt):].tolist()


def hf_logprobs(directory: Path, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at each generated position: [len(output), vocab]."""
    model = hf_model(directory)
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1]
    return torch.log_softmax(logits.float(), dim=-1)


def run_checked(engine, prompts: list[list[int]], max_tokens: int, cache_salt: str | None = None) -> list:
    """Greedy continuations (EOS ignored) generated step by step, the engine's integrity checked
    after every step; the finished outputs in the prompts' order."""
    from radixserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params, cache_salt=cache_salt) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
    return [done[i] for i in ids]


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(97) for _ in range(n)]


def resumed_turns(engine, reference: Path) -> None:
    """Two prompts (one over two chunks of 16), greedy equal to transformers on `reference`,
    then the next turn of the first resumed from the recurrent state kept at its reply's end."""
    prompts = [random_tokens(21, seed=1), random_tokens(30, seed=3)]
    outs = run_checked(engine, prompts, 8)
    for prompt, out in zip(prompts, outs):
        assert out.cached_tokens == 0 and out.token_ids == hf_greedy(reference, prompt, 8)
    follow = prompts[0] + outs[0].token_ids + random_tokens(6, seed=2)
    (second,) = run_checked(engine, [follow], 8)
    assert second.cached_tokens == 21 + 8 - 1  # the reply's end (a block end), where its state was kept
    assert second.token_ids == hf_greedy(reference, follow, 8)
    assert engine.stats()["recurrent_snapshot_restores"] == 1
