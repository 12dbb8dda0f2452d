"""Random-weight Qwen3-MoE GGUF files of released layer shapes, for speed against llama.cpp on the
same file (output quality does not matter for speed). The quantized tensors are random Q4_0 blocks
written as bytes (a small float16 scale, random 4-bit codes): nothing is quantized, a 2B-parameter
file takes seconds. Norms are ones, the router float32 (as llama.cpp's converter keeps it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


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
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    writer = GGUFWriter(str(tmp), arch="qwen3moe")
    writer.add_name(shape.name)
    writer.add_context_length(32768)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(6144)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.top_k)
    writer.add_expert_feed_forward_length(shape.expert_ffn)
    _tokenizer(writer, shape.vocab)
    q4 = GGMLQuantizationType.Q4_0
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    writer.add_tensor("token_embd.weight", _q4_0(rng, (shape.vocab, h)), raw_dtype=q4)
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    writer.add_tensor("output.weight", _q4_0(rng, (shape.vocab, h)), raw_dtype=q4)
    for i in range(shape.layers):
        blk = f"blk.{i}."
        writer.add_tensor(blk + "attn_norm.weight", np.ones(h, dtype=np.float32))
        writer.add_tensor(blk + "ffn_norm.weight", np.ones(h, dtype=np.float32))
        writer.add_tensor(blk + "attn_q_norm.weight", np.ones(shape.head_dim, dtype=np.float32))
        writer.add_tensor(blk + "attn_k_norm.weight", np.ones(shape.head_dim, dtype=np.float32))
        for name, rows, cols in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q)):
            writer.add_tensor(f"{blk}{name}.weight", _q4_0(rng, (rows, cols)), raw_dtype=q4)
        writer.add_tensor(blk + "ffn_gate_inp.weight", rng.standard_normal((shape.experts, h), dtype=np.float32))
        for name, rows, cols in (("ffn_gate_exps", shape.expert_ffn, h), ("ffn_up_exps", shape.expert_ffn, h),
                                 ("ffn_down_exps", h, shape.expert_ffn)):
            writer.add_tensor(f"{blk}{name}.weight", _q4_0(rng, (shape.experts, rows, cols)), raw_dtype=q4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    tmp.rename(path)
    return path


def _q4_0(rng: np.random.Generator, dims: tuple[int, ...]) -> np.ndarray:
    """Random Q4_0 blocks for a tensor of `dims`: [..., row bytes] uint8, 18 bytes a 32-value block."""
    *outer, row = dims
    blocks = int(np.prod(outer)) * (row // 32)
    data = np.empty((blocks, 18), dtype=np.uint8)
    scale = (rng.uniform(0.5, 1.5, blocks) * 0.02 / np.sqrt(row / 1024)).astype(np.float16)
    data[:, :2] = scale.view(np.uint8).reshape(blocks, 2)
    data[:, 2:] = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
    return data.reshape(*outer, row // 32 * 18)


def _tokenizer(writer, vocab: int) -> None:
    """A byte-level BPE vocabulary: the 256 byte symbols, then merged pairs of them."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    merges, tokens = [], list(symbols)
    for a in symbols:
        for b in symbols:
            if len(tokens) >= vocab:
                break
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens[:vocab])
    writer.add_token_types([1] * vocab)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
