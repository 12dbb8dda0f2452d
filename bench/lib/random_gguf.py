"""What the random-weight GGUF writers of the speed benches share (moe_gguf, lfm2_gguf,
qwen35_gguf): a writer opened on a `.partial` file with the header fields every architecture
has, random Q4_0 blocks written as bytes (a small float16 scale, random 4-bit codes: nothing is
quantized, so a 2B-parameter file takes seconds), a byte-level BPE vocabulary, and the file
renamed into place once whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def open_writer(path: Path, arch: str, name: str, hidden: int, layers: int, ffn: int):
    """A GGUFWriter on `path`'s .partial file, with the name, a 32k context, the width, the depth
    and the MLP width set; `finish` renames it to `path`."""
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(_partial(path)), arch=arch)
    writer.add_name(name)
    writer.add_context_length(32768)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    return writer


def finish(writer, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    _partial(path).rename(path)
    return path


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def q4_0(rng: np.random.Generator, dims: tuple[int, ...]) -> np.ndarray:
    """Random Q4_0 blocks for a tensor of `dims`: [..., row bytes] uint8, 18 bytes a 32-value block."""
    *outer, row = dims
    blocks = int(np.prod(outer)) * (row // 32)
    data = np.empty((blocks, 18), dtype=np.uint8)
    scale = (rng.uniform(0.5, 1.5, blocks) * 0.02 / np.sqrt(row / 1024)).astype(np.float16)
    data[:, :2] = scale.view(np.uint8).reshape(blocks, 2)
    data[:, 2:] = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
    return data.reshape(*outer, row // 32 * 18)


def byte_pair_tokenizer(writer, vocab: int) -> None:
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
