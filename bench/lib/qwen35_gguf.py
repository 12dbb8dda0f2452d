"""A random-weight Qwen3.5 GGUF of Qwen3.5-0.8B's shape, for speed against llama.cpp on the same
file (output quality does not matter for speed). Laid out as llama.cpp's converter writes
`qwen35`: per layer attn_norm and post_attention_norm; a Gated DeltaNet layer's attn_qkv (q, k, v
rows), attn_gate (z), ssm_alpha / ssm_beta, ssm_conv1d [C, L], ssm_a (A = -exp(A_log)), ssm_dt.bias,
ssm_norm, ssm_out; a full-attention layer's attn_q (q and its gate rows per head), attn_k, attn_v,
attn_output, q/k norms; the SwiGLU MLP; the head tied to the embedding. The 2-D weights are random
Q4_0 blocks written as bytes (bench/lib/moe_gguf.py's pieces), norms ones, the rest float32."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.lib.random_gguf import byte_pair_tokenizer, finish, open_writer, q4_0


@dataclass(frozen=True)
class Qwen35Shape:
    name: str
    hidden: int
    layers: int  # every 4th attends (full_attention_interval 4), the others are Gated DeltaNet layers
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    k_heads: int  # the DeltaNet's key heads
    v_heads: int  # its value heads
    head_k: int  # its key and value head size (llama.cpp takes one)
    vocab: int
    conv: int = 4
    arch: str = "qwen35"
    recurrent: str = "Gated DeltaNet"

    @property
    def attention(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.layers) if (i + 1) % 4 == 0)

    def params(self) -> int:
        h, d = self.hidden, self.head_dim
        attention = h * d * (2 * self.heads + 2 * self.kv_heads) + self.heads * d * h
        qkv = (2 * self.k_heads + self.v_heads) * self.head_k
        delta = h * (qkv + self.v_heads * self.head_k + 2 * self.v_heads) + self.v_heads * self.head_k * h
        mlp = 3 * h * self.ffn
        n_attention = len(self.attention)
        return n_attention * attention + (self.layers - n_attention) * delta + self.layers * mlp + self.vocab * h


# Qwen/Qwen3.5-0.8B's text model: hidden 1024, 24 layers (18 Gated DeltaNet, 6 gated attention), 8/2
# heads of 256 (a quarter rotated), MLP 3584, DeltaNet 16 key and 16 value heads of 128, conv 4,
# vocabulary 248,320, tied
SHAPES = {"qwen3.5-0.8b": Qwen35Shape("qwen3.5-0.8b", 1024, 24, 8, 2, 256, 3584, 16, 16, 128, 248320)}


def _tokenizer(writer, vocab: int) -> None:
    """moe_gguf's byte-level vocabulary (byte symbols and merged pairs: 65,792 at most), filled up
    to `vocab` with tokens no merge reaches (llama.cpp sizes the model by the token list)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    pairs = min(vocab, 256 + 256 * 256)
    if pairs == vocab:
        return byte_pair_tokenizer(writer, vocab)
    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [a + b for a in symbols for b in symbols]
    tokens += [f"<|fill_{i}|>" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * vocab)
    writer.add_token_merges([f"{a} {b}" for a in symbols for b in symbols])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)


def random_qwen35_gguf(shape: Qwen35Shape, path: Path, seed: int = 0) -> Path:
    """Write (once: an existing file is kept) a random-weight qwen35 GGUF of `shape`."""
    if path.is_file():
        return path
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(seed)
    h, d = shape.hidden, shape.head_dim
    writer = open_writer(path, "qwen35", shape.name, h, shape.layers, shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(d)
    writer.add_value_length(d)
    writer.add_rope_freq_base(1e7)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(d // 4)
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_ssm_conv_kernel(shape.conv)
    writer.add_ssm_state_size(shape.head_k)
    writer.add_ssm_group_count(shape.k_heads)
    writer.add_ssm_time_step_rank(shape.v_heads)
    writer.add_ssm_inner_size(shape.v_heads * shape.head_k)
    writer.add_full_attention_interval(4)
    _tokenizer(writer, shape.vocab)
    q4 = GGMLQuantizationType.Q4_0
    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    writer.add_tensor("token_embd.weight", q4_0(rng, (shape.vocab, h)), raw_dtype=q4)
    writer.add_tensor("output_norm.weight", ones(h))
    value = shape.v_heads * shape.head_k
    channels = 2 * shape.k_heads * shape.head_k + value
    for i in range(shape.layers):
        blk = f"blk.{i}."
        writer.add_tensor(blk + "attn_norm.weight", ones(h))
        writer.add_tensor(blk + "post_attention_norm.weight", ones(h))
        if i in shape.attention:
            writer.add_tensor(blk + "attn_q_norm.weight", ones(d))
            writer.add_tensor(blk + "attn_k_norm.weight", ones(d))
            weights = (("attn_q", 2 * shape.heads * d, h), ("attn_k", shape.kv_heads * d, h),
                       ("attn_v", shape.kv_heads * d, h), ("attn_output", h, shape.heads * d))
        else:
            writer.add_tensor(blk + "ssm_conv1d.weight", rng.uniform(-0.5, 0.5, (channels, shape.conv)).astype(np.float32))
            writer.add_tensor(blk + "ssm_a", -rng.uniform(0.5, 8.0, shape.v_heads).astype(np.float32))
            writer.add_tensor(blk + "ssm_dt.bias", ones(shape.v_heads))
            writer.add_tensor(blk + "ssm_norm.weight", ones(shape.head_k))
            weights = (("attn_qkv", channels, h), ("attn_gate", value, h), ("ssm_alpha", shape.v_heads, h),
                       ("ssm_beta", shape.v_heads, h), ("ssm_out", h, value))
        weights += (("ffn_gate", shape.ffn, h), ("ffn_up", shape.ffn, h), ("ffn_down", h, shape.ffn))
        for name, rows, cols in weights:
            writer.add_tensor(f"{blk}{name}.weight", q4_0(rng, (rows, cols)), raw_dtype=q4)
    return finish(writer, path)
