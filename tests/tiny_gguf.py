"""Tiny GGUF files written from tiny random transformers models, as llama.cpp's converter lays
them out (its tensor names, its metadata keys, Gemma 3's norms stored as 1 + w, experts stacked
per layer), with a byte-level tokenizer that transformers can read back. No hub access."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# transformers' name under model.layers.N -> llama.cpp's block tensor stem
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
_GEMMA3 = {**_LAYER, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
           "post_feedforward_layernorm": "post_ffw_norm"}
_LFM2 = {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_output",
         "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
         "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down",
         "conv.in_proj": "shortconv.in_proj", "conv.conv": "shortconv.conv", "conv.out_proj": "shortconv.out_proj"}
_QWEN35 = {**_LAYER, "post_attention_layernorm": "post_attention_norm",
           "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
           "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.in_proj_b": "ssm_beta",
           "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out",
           "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
           "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_GRANITE = {**_LAYER, "mamba.in_proj": "ssm_in", "mamba.conv1d": "ssm_conv1d", "mamba.out_proj": "ssm_out",
            "mamba.norm": "ssm_norm", "block_sparse_moe.router.layer": "ffn_gate_inp"}
_GPT_OSS = {**_LAYER, "post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
        "model.embedding_norm": "token_embd_norm"}
_ARCH = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "qwen3": "qwen3", "qwen2": "qwen2", "lfm2": "lfm2",
         "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "granitemoehybrid": "granitehybrid",
         "gpt_oss": "gpt-oss"}


def write_gguf(model_dir: Path, path: Path, quant: str = "Q8_0", mtp: bool = False,
               expert_quant: str | None = None, specials: tuple[str, ...] = (), eos: str | None = None) -> Path:
    """The model saved in `model_dir` as a GGUF at `path`: 2-D weights with 64-multiple rows
    (and the stacked experts) quantized to `quant` (F32 keeps them float), the rest float32;
    the stacked experts to `expert_quant` where given (gpt-oss's MXFP4).
    `mtp`: one more block after the model's, as llama.cpp's converter appends Qwen3.5's
    multi-token-prediction layer (random values: a reader must leave it out).
    `specials`: control tokens at the vocabulary's end, `eos` the one the header names (else id 1)."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    arch = _ARCH[config.model_type]
    tensors = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    writer = GGUFWriter(str(path), arch=arch)
    _metadata(writer, arch, config, extra_blocks=int(mtp))
    _tokenizer(writer, config.vocab_size, specials, eos)
    for name, t in [*_gguf_tensors(tensors, arch, config), *(_mtp_block(config) if mtp else [])]:
        data = t.float().numpy()
        # routers, norms and biases (gpt-oss's experts' [E, out]) stay float, as llama.cpp keeps them
        plain = "ffn_gate_inp" in name or "ssm_norm" in name or name.endswith(".bias")
        kind = GGMLQuantizationType[expert_quant if expert_quant and name.endswith("_exps.weight") else quant]
        if kind != GGMLQuantizationType.F32 and data.ndim >= 2 and data.shape[-1] % 64 == 0 and not plain:
            writer.add_tensor(name, quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensors(tensors: dict[str, torch.Tensor], arch: str, config):
    names = {"gemma3": _GEMMA3, "lfm2": _LFM2, "qwen35": _QWEN35, "qwen35moe": _QWEN35,
             "granitehybrid": _GRANITE, "gpt-oss": _GPT_OSS}.get(arch, _LAYER)
    for layer in range(config.num_hidden_layers):  # per-expert tensors stacked [E, out, in], as llama.cpp stores them
        for proj, stem in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            parts = [tensors.get(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight")
                     for e in range(getattr(config, "num_experts", 0) or 0)]
            if parts and all(p is not None for p in parts):
                yield f"blk.{layer}.{stem}.weight", torch.stack(parts)
    for name, t in tensors.items():
        if name.startswith("lm_head") and getattr(config, "tie_word_embeddings", False):
            continue
        stem, _, suffix = name.rpartition(".")
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1.0  # llama.cpp stores Gemma's (1 + w)
        if name.endswith(".conv.conv.weight"):
            t = t.squeeze(1)  # LFM2's depthwise conv as llama.cpp stores it, [C, L]
        if arch in ("qwen35", "qwen35moe"):
            name, t = _qwen35_tensor(name, t, config)
            stem, _, suffix = name.rpartition(".")
        if arch == "granitehybrid" and (".mamba." in name or "block_sparse_moe.input_linear" in name
                                        or "block_sparse_moe.output_linear" in name or ".shared_mlp." in name):
            yield from _granite_tensors(name, t, config)
            continue
        if arch == "gpt-oss" and (".mlp.experts." in name or name.endswith(".self_attn.sinks")):
            yield from _gpt_oss_tensors(name, t)
            continue
        if stem in _TOP:
            yield f"{_TOP[stem]}.{suffix}", t
            continue
        parts = name.split(".")  # model.layers.N.<rest>
        layer, rest = parts[2], ".".join(parts[3:])
        if rest in ("linear_attn.A_log", "linear_attn.dt_bias"):  # whole names: ssm_a (no suffix), ssm_dt.bias
            yield f"blk.{layer}.{'ssm_a' if rest.endswith('A_log') else 'ssm_dt.bias'}", t
            continue
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            gate, up = t.chunk(2, dim=1)
            yield f"blk.{layer}.ffn_gate_exps.weight", gate.contiguous()
            yield f"blk.{layer}.ffn_up_exps.weight", up.contiguous()
        elif rest == "mlp.experts.down_proj":
            yield f"blk.{layer}.ffn_down_exps.weight", t
        elif ".experts." in rest:  # per expert (mlp.experts.E.gate_proj.weight): stacked below
            continue
        else:
            yield f"blk.{layer}.{names[rest.rpartition('.')[0]]}.{suffix}", t


def _qwen35_tensor(name: str, t: torch.Tensor, config) -> tuple[str, torch.Tensor]:
    """A Qwen3.5 tensor as llama.cpp's converter writes it: norms (but the DeltaNet's) as 1 + w,
    A_log as A = -exp(A_log), the conv squeezed to [C, L], and with more value heads than key
    heads, the value heads reordered from grouped by key head to tiled."""
    if name.endswith("norm.weight") and ".linear_attn." not in name:
        t = t + 1.0
    if name.endswith("linear_attn.A_log"):
        t = -torch.exp(t.float())
    if name.endswith("linear_attn.conv1d.weight"):
        t = t.squeeze(1)
    k, v = config.linear_num_key_heads, config.linear_num_value_heads
    if ".linear_attn." in name and k != v:
        dv, qk = config.linear_value_head_dim, 2 * k * config.linear_key_head_dim

        def tiled(x, dim, size):  # [k, v / k, size] along dim -> [v / k, k, size]
            index = torch.arange(x.shape[dim]).reshape(k, v // k, size).transpose(0, 1).reshape(-1)
            return x.index_select(dim, index)

        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            t = torch.cat((t[:qk], tiled(t[qk:], 0, dv)))
        elif name.endswith("in_proj_z.weight"):
            t = tiled(t, 0, dv)
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            t = tiled(t, 0, 1)
        elif name.endswith("out_proj.weight"):
            t = tiled(t, 1, dv)
    return name, t


def _granite_tensors(name: str, t: torch.Tensor, config):
    """A Granite 4.0-H tensor as llama.cpp's converter writes it: A_log as A = -exp(A_log) and D
    as [H, 1], the gated norm as [groups, inner / groups], the conv squeezed to [C, L]; the fused
    [gate; up] experts and shared MLP split (the shared one as ffn_*_shexp beside experts, plain
    ffn_* without)."""
    layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
    blk = f"blk.{layer}."
    shexp = "_shexp" if config.num_local_experts else ""
    if rest == "mamba.A_log":
        yield blk + "ssm_a", (-torch.exp(t.float())).reshape(-1, 1)
    elif rest == "mamba.D":
        yield blk + "ssm_d", t.reshape(-1, 1)
    elif rest == "mamba.dt_bias":
        yield blk + "ssm_dt.bias", t
    elif rest == "mamba.norm.weight":
        yield blk + "ssm_norm.weight", t.reshape(config.mamba_n_groups, -1)
    elif rest == "mamba.conv1d.weight":
        yield blk + "ssm_conv1d.weight", t.squeeze(1)
    elif rest.startswith("mamba."):
        stem, _, suffix = rest.rpartition(".")
        yield f"{blk}{_GRANITE[stem]}.{suffix}", t
    elif rest == "block_sparse_moe.input_linear.weight":  # [E, 2I, H]
        gate, up = t.chunk(2, dim=1)
        yield blk + "ffn_gate_exps.weight", gate.contiguous()
        yield blk + "ffn_up_exps.weight", up.contiguous()
    elif rest == "block_sparse_moe.output_linear.weight":
        yield blk + "ffn_down_exps.weight", t
    elif rest == "shared_mlp.input_linear.weight":
        gate, up = t.chunk(2, dim=0)
        yield f"{blk}ffn_gate{shexp}.weight", gate.contiguous()
        yield f"{blk}ffn_up{shexp}.weight", up.contiguous()
    elif rest == "shared_mlp.output_linear.weight":
        yield f"{blk}ffn_down{shexp}.weight", t
    else:
        raise ValueError(f"no granitehybrid name for {name}")


def _gpt_oss_tensors(name: str, t: torch.Tensor):
    """A gpt-oss tensor as llama.cpp's converter writes it: the sinks as attn_sinks.weight; the
    experts' gate_up_proj [E, H, 2I] (x @ w, gate and up interleaved column by column) split into
    gate and up [E, I, H], down_proj [E, I, H] as [E, H, I], their biases split alike."""
    layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
    blk = f"blk.{layer}."
    if rest == "self_attn.sinks":
        yield blk + "attn_sinks.weight", t
    elif rest == "mlp.experts.gate_up_proj":
        t = t.transpose(1, 2)
        yield blk + "ffn_gate_exps.weight", t[:, 0::2].contiguous()
        yield blk + "ffn_up_exps.weight", t[:, 1::2].contiguous()
    elif rest == "mlp.experts.gate_up_proj_bias":
        yield blk + "ffn_gate_exps.bias", t[:, 0::2].contiguous()
        yield blk + "ffn_up_exps.bias", t[:, 1::2].contiguous()
    elif rest == "mlp.experts.down_proj":
        yield blk + "ffn_down_exps.weight", t.transpose(1, 2).contiguous()
    elif rest == "mlp.experts.down_proj_bias":
        yield blk + "ffn_down_exps.bias", t
    else:
        raise ValueError(f"no gpt-oss name for {name}")


def quant_rounded(model_dir: Path, out_dir: Path, quant: str) -> Path:
    """A copy of the transformers checkpoint in `model_dir` holding the values its GGUF of
    `quant` holds (each tensor write_gguf quantizes, quantized and dequantized by its rows): the
    reference for a file transformers cannot read. Valid where write_gguf's transforms of those
    tensors only reorder or stack rows."""
    import shutil

    from gguf import GGMLQuantizationType, quants
    from safetensors.torch import load_file, save_file

    kind = GGMLQuantizationType[quant]
    shutil.copytree(model_dir, out_dir)
    for f in sorted(Path(out_dir).glob("*.safetensors")):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            router = name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "router.layer.weight"))
            if t.dim() >= 2 and t.shape[-1] % 64 == 0 and not router:
                assert "out_proj" not in name or ".linear_attn." not in name, "columns reordered: not row-wise"
                data = t.float().numpy()
                tensors[name] = torch.from_numpy(quants.dequantize(quants.quantize(data, kind), kind).reshape(data.shape))
        save_file(tensors, str(f), metadata={"format": "pt"})
    return out_dir


def _mtp_block(config):
    """A Qwen3.5 multi-token-prediction block as llama.cpp names it (blk.{layers}: nextn.* and an
    attention layer's tensors), random."""
    h, blk = config.hidden_size, f"blk.{config.num_hidden_layers}."
    for name, shape in (("nextn.eh_proj.weight", (h, 2 * h)), ("nextn.enorm.weight", (h,)),
                        ("nextn.hnorm.weight", (h,)), ("nextn.shared_head_norm.weight", (h,)),
                        ("attn_norm.weight", (h,)), ("attn_k.weight", (config.num_key_value_heads * config.head_dim, h))):
        yield blk + name, torch.randn(shape)


def _metadata(writer, arch: str, config, extra_blocks: int = 0) -> None:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers + extra_blocks)
    if extra_blocks:
        writer.add_nextn_predict_layers(extra_blocks)
    if arch == "lfm2":  # as llama.cpp's converter: the MLP's real width, kv heads 0 on conv layers
        from radixserve.model.lfm2 import _mlp_width

        writer.add_feed_forward_length(_mlp_width(config))
        writer.add_head_count_kv([config.num_key_value_heads if t == "full_attention" else 0
                                  for t in config.layer_types])
        writer.add_shortconv_l_cache(config.conv_L_cache)
        writer.add_vocab_size(config.vocab_size)
    elif arch == "granitehybrid":  # kv heads 0 on the Mamba2 layers
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count_kv([config.num_key_value_heads if t == "full_attention" else 0
                                  for t in config.layer_types])
    else:
        writer.add_feed_forward_length(getattr(config, "intermediate_size", 0) or 0)
        writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_head_count(heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.norm_eps if arch == "lfm2" else config.rms_norm_eps)
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if "rope_theta" in rope else rope.get("full_attention", {}).get("rope_theta")
    writer.add_rope_freq_base(float(theta or 10000.0))
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    if arch in ("qwen35", "qwen35moe"):  # as llama.cpp's Qwen3-Next converter writes them
        writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
        writer.add_ssm_state_size(config.linear_key_head_dim)
        writer.add_ssm_group_count(config.linear_num_key_heads)
        writer.add_ssm_time_step_rank(config.linear_num_value_heads)
        writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
        writer.add_full_attention_interval(4)
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    if arch == "granitehybrid":  # as llama.cpp's GraniteHybrid converter writes them
        writer.add_ssm_conv_kernel(config.mamba_d_conv)
        writer.add_ssm_state_size(config.mamba_d_state)
        writer.add_ssm_group_count(config.mamba_n_groups)
        writer.add_ssm_inner_size(config.mamba_expand * config.hidden_size)
        writer.add_ssm_time_step_rank(config.mamba_n_heads)
        writer.add_rope_scaling_finetuned(config.position_embedding_type == "rope")
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_logit_scale(config.logits_scaling)
        if config.num_local_experts:
            writer.add_expert_count(config.num_local_experts)
            writer.add_expert_used_count(config.num_experts_per_tok)
            writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    if arch == "qwen35moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == "gpt-oss":  # as llama.cpp's GptOss converter writes them: the window, the experts, YaRN
        writer.add_sliding_window(config.sliding_window)
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.intermediate_size)
        if rope.get("rope_type") == "yarn":
            from gguf import RopeScalingType

            writer.add_rope_scaling_type(RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch in ("qwen3moe", "qwen35moe"):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def _tokenizer(writer, vocab_size: int, specials: tuple[str, ...] = (), eos: str | None = None) -> None:
    """A byte-level BPE vocabulary: single characters, one merged pair, then `specials` (CONTROL)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    plain = alphabet[:vocab_size - 1 - len(specials)] + ['!"']
    tokens = plain + list(specials)
    assert not specials or len(tokens) == vocab_size, "a vocab_size past the byte alphabet and the specials"
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(plain) + [3] * len(specials))
    writer.add_token_merges(['! "'])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1 if eos is None else tokens.index(eos))
