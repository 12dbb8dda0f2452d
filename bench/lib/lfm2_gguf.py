"""A random-weight LFM2 GGUF of LFM2-350M's shape, for speed against llama.cpp on the same file
(output quality does not matter for speed). Laid out as llama.cpp's converter writes `lfm2`: kv
heads per layer (0 on the conv layers), the conv weight squeezed to [C, L], the final norm as
token_embd_norm, the head tied to the embedding. The 2-D weights are random Q4_0 blocks written as
bytes (bench/lib/moe_gguf.py's pieces), norms ones, the conv weight float32."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.lib.random_gguf import byte_pair_tokenizer, finish, open_writer, q4_0


@dataclass(frozen=True)
class Lfm2Shape:
    name: str
    hidden: int
    layers: int
    attention: tuple[int, ...]  # the full-attention layers (the others: short convolutions)
    heads: int
    kv_heads: int
    ffn: int  # the MLP's width as held (LFM2's block_auto_adjust_ff_dim applied)
    conv: int  # conv_L_cache
    vocab: int

    def params(self) -> int:
        head_dim = self.hidden // self.heads
        attention = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)
        conv = 4 * self.hidden * self.hidden
        mlp = 3 * self.hidden * self.ffn
        return (len(self.attention) * attention + (self.layers - len(self.attention)) * conv
                + self.layers * mlp + self.vocab * self.hidden)


# LiquidAI/LFM2-350M: hidden 1024, 16 layers of which 6 attend (2, 5, 8, 10, 12, 14), 16/8 heads of
# 64, intermediate_size 6656 auto-adjusted to 4608 (multiple of 256), conv L 3, vocabulary 65,536
SHAPES = {"lfm2-350m": Lfm2Shape("lfm2-350m", 1024, 16, (2, 5, 8, 10, 12, 14), 16, 8, 4608, 3, 65536)}


def random_lfm2_gguf(shape: Lfm2Shape, path: Path, seed: int = 0) -> Path:
    """Write (once: an existing file is kept) a random-weight lfm2 GGUF of `shape`."""
    if path.is_file():
        return path
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(seed)
    h, head_dim = shape.hidden, shape.hidden // shape.heads
    writer = open_writer(path, "lfm2", shape.name, h, shape.layers, shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv([shape.kv_heads if i in shape.attention else 0 for i in range(shape.layers)])
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_shortconv_l_cache(shape.conv)
    byte_pair_tokenizer(writer, shape.vocab)
    q4 = GGMLQuantizationType.Q4_0
    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    writer.add_tensor("token_embd.weight", q4_0(rng, (shape.vocab, h)), raw_dtype=q4)
    writer.add_tensor("token_embd_norm.weight", ones(h))
    kv = shape.kv_heads * head_dim
    for i in range(shape.layers):
        blk = f"blk.{i}."
        writer.add_tensor(blk + "attn_norm.weight", ones(h))
        writer.add_tensor(blk + "ffn_norm.weight", ones(h))
        if i in shape.attention:
            writer.add_tensor(blk + "attn_q_norm.weight", ones(head_dim))
            writer.add_tensor(blk + "attn_k_norm.weight", ones(head_dim))
            weights = (("attn_q", h, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, h))
        else:
            conv = rng.uniform(-0.5, 0.5, (h, shape.conv)).astype(np.float32)
            writer.add_tensor(blk + "shortconv.conv.weight", conv)
            weights = (("shortconv.in_proj", 3 * h, h), ("shortconv.out_proj", h, h))
        weights += (("ffn_gate", shape.ffn, h), ("ffn_up", shape.ffn, h), ("ffn_down", h, shape.ffn))
        for name, rows, cols in weights:
            writer.add_tensor(f"{blk}{name}.weight", q4_0(rng, (rows, cols)), raw_dtype=q4)
    return finish(writer, path)
