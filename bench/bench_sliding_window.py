"""Decode attention of one request with a sliding window against full attention, on CPU.

    python -m bench.bench_sliding_window                        # context 4096, window 512
    python -m bench.bench_sliding_window --context 8192 --window 1024 --threads 2

One query row over a context of --context tokens whose blocks lie scattered in a pool, timed
for a full layer (window 0) and a sliding-window layer (--window): the C decode kernel (the
cpu backend's), float32 and int8 pages, and the torch backend's decode (the reference), on
SmolLM2-135M's heads (9 query, 3 KV, head_dim 64) and Gemma 3 270M's (4 query, 1 KV, head_dim
256). Each time is the median of --repeats calls after a warm-up; the ratio is window / full.
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from bench.lib.cli import Figures, apply_quick, bench_parser
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.kernels.native_attention import load_native_attention
from radixserve.kernels.quantized_pages import QuantizedPages

GEOMETRIES = {"SmolLM2-135M": (9, 3, 64), "Gemma-3-270M": (4, 1, 256)}
BLOCK_SIZE = 16


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _request(context: int, heads: int, kv_heads: int, head_dim: int, int8: bool):
    """One request's q, its scattered blocks in a pool four times its size, and the metadata."""
    blocks = -(-context // BLOCK_SIZE)
    num_blocks = 4 * blocks
    table = random.Random(0).sample(range(num_blocks), blocks)
    pages = QuantizedPages(BLOCK_SIZE, kv_heads, head_dim) if int8 else None
    if int8:
        pool = torch.randint(-127, 128, (2, num_blocks, pages.page_bytes), dtype=torch.int8).view(torch.uint8)
        pages.scales(pool[0]).fill_(0.01)
        pages.scales(pool[1]).fill_(0.01)
    else:
        pool = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    meta = AttentionMetadata(
        num_decodes=1, block_size=BLOCK_SIZE, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([context], dtype=torch.int32), block_tables=torch.tensor([table], dtype=torch.int32),
        slot_mapping=torch.tensor([table[-1] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE]),
        query_start_loc_list=[0, 1], seq_lens_list=[context])
    return torch.randn(1, heads, head_dim), pool, pages, meta


def main() -> None:
    parser = bench_parser(__doc__, quick="20 repeats")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch (and the kernels') threads")
    args = parser.parse_args()
    apply_quick(parser, args, repeats=20)
    torch.set_num_threads(args.threads)
    figures = Figures()
    kernels = load_native_attention()
    print(f"decode attention, 1 request, context {args.context}, window {args.window} vs 0, block size {BLOCK_SIZE}, "
          f"{args.threads} thread(s), median of {args.repeats}; ms")
    print(f"{'heads':<14} {'path':<22} {'full':>8} {'window':>8} {'ratio':>7}")
    for name, (heads, kv_heads, head_dim) in GEOMETRIES.items():
        for path, int8 in (("C kernel, float32", False), ("C kernel, int8 pages", True), ("torch backend", False)):
            q, pool, pages, meta = _request(args.context, heads, kv_heads, head_dim, int8)
            scale = head_dim**-0.5
            if path == "torch backend":
                backend = TorchAttentionBackend(heads, kv_heads, head_dim, scale)
                plan = backend.prepare(meta)
                k = v = torch.randn(1, kv_heads, head_dim)
                timed = {w: (lambda w=w: backend.forward(q, k, v, pool[0], pool[1], plan, w)) for w in (0, args.window)}
            elif kernels is None:
                continue
            else:
                tables, lens = meta.block_tables, meta.seq_lens
                timed = {w: (lambda w=w: kernels.decode(q, pool[0], pool[1], tables, lens, scale, pages, w))
                         for w in (0, args.window)}
            full, windowed = (_median_ms(timed[w], args.repeats) for w in (0, args.window))
            print(f"{name:<14} {path:<22} {full:8.3f} {windowed:8.3f} {windowed / full:7.3f}")
            figures.add(f"{name}, {path}", "full", full)
            figures.add(f"{name}, {path}", f"window {args.window}", windowed)
    figures.finish(args, f"decode attention ms, context {args.context}", "ms")


if __name__ == "__main__":
    main()
