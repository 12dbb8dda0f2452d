"""Random-weight Qwen3-MoE GGUF files of released layer shapes, for speed against llama.cpp on the
same file (output quality does not matter for speed). The quantized tensors are random Q4_0 blocks
(bench/lib/random_gguf.py). Norms are ones, the router float32 (as llama.cpp's converter keeps it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.lib.random_gguf import byte_pair_tokenizer, finish, open_writer, q4_0


@dataclass(frozen=True)
class MoEShape:
    name: str
    hidden: int
    layers: int
    experts: int
    top_k: int
    expert_ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        experts = 3 * self.experts * self.expert_ffn * self.hidden + self.experts * self.hidden
        return self.layers * (attention + experts) + 2 * self.vocab * self.hidden


# Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768, top 8, 32/4 heads of 128), in 3 layers
# instead of 48 (2.0B parameters; a vocabulary of 40,960 for the benches' random token ids).
SHAPES = {"qwen3-30b-a3b-3l": MoEShape("qwen3-30b-a3b-3l", 2048, 3, 128, 8, 768, 32, 4, 128, 40960)}


def random_moe_gguf(shape: MoEShape, path: Path, seed: int = 0) -> Path:
    """Write (once: an existing file is kept) a random-weight qwen3moe GGUF of `shape`."""
    if path.is_file():
        return path
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(seed)
    writer = open_writer(path, "qwen3moe", shape.name, shape.hidden, shape.layers, 6144)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.top_k)
    writer.add_expert_feed_forward_length(shape.expert_ffn)
    byte_pair_tokenizer(writer, shape.vocab)
    q4 = GGMLQuantizationType.Q4_0
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    writer.add_tensor("token_embd.weight", q4_0(rng, (shape.vocab, h)), raw_dtype=q4)
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    writer.add_tensor("output.weight", q4_0(rng, (shape.vocab, h)), raw_dtype=q4)
    for i in range(shape.layers):
        blk = f"blk.{i}."
        writer.add_tensor(blk + "attn_norm.weight", np.ones(h, dtype=np.float32))
        writer.add_tensor(blk + "ffn_norm.weight", np.ones(h, dtype=np.float32))
        writer.add_tensor(blk + "attn_q_norm.weight", np.ones(shape.head_dim, dtype=np.float32))
        writer.add_tensor(blk + "attn_k_norm.weight", np.ones(shape.head_dim, dtype=np.float32))
        for name, rows, cols in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q)):
            writer.add_tensor(f"{blk}{name}.weight", q4_0(rng, (rows, cols)), raw_dtype=q4)
        writer.add_tensor(blk + "ffn_gate_inp.weight", rng.standard_normal((shape.experts, h), dtype=np.float32))
        for name, rows, cols in (("ffn_gate_exps", shape.expert_ffn, h), ("ffn_up_exps", shape.expert_ffn, h),
                                 ("ffn_down_exps", h, shape.expert_ffn)):
            writer.add_tensor(f"{blk}{name}.weight", q4_0(rng, (shape.experts, rows, cols)), raw_dtype=q4)
    return finish(writer, path)
