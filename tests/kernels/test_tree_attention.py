"""Draft-tree rows in decode attention (attention/metadata.py's tree_masks) on every backend:
the C kernel (float32 and int8 pages), the torch backend, and the Triton kernel (in Triton's
interpreter), each against a float64 softmax over the keys a tree node sees, listed from its
path (the prefix, then its ancestors and itself, at positions base + depth): GQA, windows that
cut the prefix and the ancestors (a window counts positions, not slots), attention sinks,
trees over several blocks, a 64-node tree (bit 63), and a chain (whose masks read as none).
"""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.kernels.triton import configure_triton  # imports no triton

configure_triton(torch.device("cpu"))  # before triton's first import

from radixserve.attention.cpu_backend import CpuAttentionBackend  # noqa: E402
from radixserve.attention.metadata import AttentionMetadata, tree_view  # noqa: E402
from radixserve.attention.torch_backend import TorchAttentionBackend, store_kv  # noqa: E402
from radixserve.kernels.native_attention import load_native_attention  # noqa: E402
from radixserve.kernels.quantized_pages import QuantizedPages, dequantize, quantize  # noqa: E402

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False

needs_native = pytest.mark.skipif(load_native_attention() is None, reason="C kernels not built here")
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")


def _triton_backend(*args, **kwargs):
    from radixserve.attention.triton_backend import TritonAttentionBackend
    return TritonAttentionBackend(*args, **kwargs)


TREES = {
    "branches": [-1, 0, 0, 1, 1, 2, -1, 6],  # two roots' subtrees, branching at depth 0 and 1
    "chain": [-1, 0, 1, 2, 3],
    "wide64": [-1] + [random.Random(5).randrange(-1, i) for i in range(1, 64)],
}


def tree_masks(parents: list[int]) -> list[int]:
    """Each node's mask: its own bit and its ancestors' (bit i: node i)."""
    masks = []
    for i, parent in enumerate(parents):
        masks.append((1 << i) | (masks[parent] if parent >= 0 else 0))
    return masks


def depths(parents: list[int]) -> list[int]:
    out = []
    for parent in parents:
        out.append(out[parent] + 1 if parent >= 0 else 0)
    return out


class TreeStep:
    """One step: request A decodes its last token (slot start) with a draft tree after it
    (node i at slot start + 1 + i); request B, another table, an ordinary decode beside it."""

    def __init__(self, parents, start, *, heads, kv_heads, head_dim, block_size, int8=False, seed=0):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        n = len(parents)
        base = start + 1
        other = 11  # request B's context
        num_blocks = -(-(base + n) // block_size) + -(-other // block_size) + 2
        free = list(range(num_blocks))
        rng.shuffle(free)
        table_a = [free.pop() for _ in range(-(-(base + n) // block_size))]
        table_b = [free.pop() for _ in range(-(-other // block_size))]
        self.pages = QuantizedPages(block_size, kv_heads, head_dim) if int8 else None
        if int8:
            self.pool = torch.zeros(2, num_blocks, self.pages.page_bytes, dtype=torch.uint8)
        else:
            self.pool = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim)
        slot = lambda table, s: table[s // block_size] * block_size + s % block_size  # noqa: E731
        keys_a = torch.randn(base + n, kv_heads, head_dim, generator=gen)
        values_a = torch.randn(base + n, kv_heads, head_dim, generator=gen)
        keys_b = torch.randn(other, kv_heads, head_dim, generator=gen)
        values_b = torch.randn(other, kv_heads, head_dim, generator=gen)
        earlier_a = torch.tensor([slot(table_a, s) for s in range(start)], dtype=torch.int64)
        earlier_b = torch.tensor([slot(table_b, s) for s in range(other - 1)], dtype=torch.int64)
        store_kv(keys_a[:start], values_a[:start], self.pool[0], self.pool[1], earlier_a, self.pages)
        store_kv(keys_b[:-1], values_b[:-1], self.pool[0], self.pool[1], earlier_b, self.pages)
        # the step's rows: B's decode, A's last token, A's tree nodes
        self.k = torch.cat([keys_b[-1:], keys_a[start:]])
        self.v = torch.cat([values_b[-1:], values_a[start:]])
        slots = [slot(table_b, other - 1)] + [slot(table_a, s) for s in range(start, base + n)]
        seq_lens = [other, base] + [base + i + 1 for i in range(n)]
        masks = [0, 0] + tree_masks(parents)
        rows = len(seq_lens)
        width = max(len(table_a), len(table_b))
        tables = [table_b + [0] * (width - len(table_b))] + [table_a + [0] * (width - len(table_a))] * (rows - 1)
        self.q = torch.randn(rows, heads, head_dim, generator=gen)
        self.scale = head_dim ** -0.5
        self.meta = AttentionMetadata(
            num_decodes=rows, block_size=block_size,
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_list=list(range(rows + 1)), seq_lens_list=seq_lens,
            tree_masks=torch.tensor([m - (1 << 64) if m >= 1 << 63 else m for m in masks], dtype=torch.int64),
            tree_masks_list=masks,
        )
        if int8:  # the keys as the pages hold them
            keys_a, values_a, keys_b, values_b = (dequantize(*quantize(x)) for x in (keys_a, values_a, keys_b,
                                                                                       values_b))
        # each row's keys as (position, key, value) from its path, independent of the masks
        depth = depths(parents)
        self.contexts = [[(p, keys_b[p], values_b[p]) for p in range(other)],
                         [(p, keys_a[p], values_a[p]) for p in range(base)]]
        for i in range(n):
            path, node = [], i
            while node >= 0:
                path.append(node)
                node = parents[node]
            context = [(p, keys_a[p], values_a[p]) for p in range(base)]
            context += [(base + depth[a], keys_a[base + a], values_a[base + a]) for a in reversed(path)]
            self.contexts.append(context)

    def dense(self, window: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Each row against the keys its path gives, by a float64 softmax (window: the keys
        whose position is within `window` of the row's own)."""
        out = torch.empty_like(self.q)
        group = self.q.shape[1] // self.k.shape[1]
        for r, context in enumerate(self.contexts):
            position = context[-1][0]
            kept = [(k, v) for p, k, v in context if not window or p > position - window]
            keys = torch.stack([k for k, _ in kept]).double().repeat_interleave(group, 1)
            values = torch.stack([v for _, v in kept]).double().repeat_interleave(group, 1)
            scores = torch.einsum("hd,thd->ht", self.q[r].double(), keys) * self.scale
            if sinks is not None:
                scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
            weights = scores.softmax(-1)[:, :keys.shape[0]]
            out[r] = torch.einsum("ht,thd->hd", weights, values).float()
        return out

    def run(self, backend_class, window: int, sinks=None, **options):
        backend = backend_class(self.q.shape[1], self.k.shape[1], self.q.shape[2], self.scale, pages=self.pages,
                                **options)
        pool = self.pool.clone()
        return backend.forward(self.q, self.k, self.v, pool[0], pool[1], backend.prepare(self.meta), window, sinks)


BACKENDS = [
    pytest.param(TorchAttentionBackend, id="torch"),
    pytest.param(CpuAttentionBackend, id="cpu", marks=needs_native),
]
GEOMETRIES = {"mha": (2, 2, 16), "gqa": (6, 2, 32)}
WINDOWS = [0, 2, 3, 7, 1000]  # 2, 3: shorter than the tree's depth, cutting ancestors


def _tolerance(int8):
    return dict(atol=5e-5, rtol=5e-5) if not int8 else dict(atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("tree", ["branches", "chain"])
@pytest.mark.parametrize("backend_class", BACKENDS)
def test_tree_rows_see_their_path(backend_class, tree, block_size, geometry, int8):
    heads, kv_heads, head_dim = GEOMETRIES[geometry]
    for start in (0, 6, 21):
        step = TreeStep(TREES[tree], start, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                        block_size=block_size, int8=int8, seed=start + block_size)
        for window in WINDOWS:
            out = step.run(backend_class, window)
            torch.testing.assert_close(out, step.dense(window), **_tolerance(int8),
                                       msg=lambda m: f"start {start} window {window}: {m}")


@needs_native
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_tree_rows_over_a_context_of_several_chunks(int8, threads):
    """A tree after 300 tokens of context: the C kernel folds the context in 128-key chunks merged
    in order, then the tree's own keys. On one thread each group is walked whole, its chunks
    merged in turn; on two, each chunk is a work item of its own, merged after. float64's values
    with and without a window, sinks too (each way fails with the last chunk left out)."""
    heads, kv_heads, head_dim = GEOMETRIES["gqa"]
    step = TreeStep(TREES["branches"], 300, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                    int8=int8, seed=3)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(4))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for window, with_sinks in ((0, None), (3, None), (200, None), (0, sinks)):
            torch.testing.assert_close(step.run(CpuAttentionBackend, window, with_sinks),
                                       step.dense(window, with_sinks), **_tolerance(int8))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("backend_class", BACKENDS)
def test_tree_rows_with_sinks_and_64_nodes(backend_class):
    heads, kv_heads, head_dim = GEOMETRIES["gqa"]
    step = TreeStep(TREES["wide64"], 9, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16, seed=2)
    sinks = torch.randn(heads)
    for window in (0, 5):
        torch.testing.assert_close(step.run(backend_class, window, sinks), step.dense(window, sinks),
                                   **_tolerance(False))


@needs_triton
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_triton_tree_rows_see_their_path(int8):
    """Triton's interpreter (slow): GQA, a tree over several blocks, windows cutting ancestors,
    sinks, and the 64-node tree."""
    heads, kv_heads, head_dim = GEOMETRIES["gqa"]
    step = TreeStep(TREES["branches"], 6, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=4,
                    int8=int8, seed=1)
    for window in (0, 3, 7):
        torch.testing.assert_close(step.run(_triton_backend, window), step.dense(window), **_tolerance(int8))
    big = TreeStep(TREES["wide64"], 9, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                   int8=int8, seed=2)
    sinks = torch.randn(heads)
    torch.testing.assert_close(big.run(_triton_backend, 5, sinks), big.dense(5, sinks), **_tolerance(int8))


def test_tree_view_reads_a_mask():
    # base 10 (seq_len 10 + 3 = 13 for node 2 of parents [-1, 0, 0]: mask 0b101)
    assert tree_view(13, 0b101, 0) == (0, [10, 12])
    # its position is 11: window 2 sees positions 10 and 11 (node 0 and itself), none before base
    assert tree_view(13, 0b101, 2) == (10, [10, 12])
    assert tree_view(13, 0b101, 1) == (10, [12])
    assert tree_view(13, 0b101, 4) == (8, [10, 12])
    assert tree_view(13, 0, 4) == (9, [])


@needs_native
def test_native_decode_refuses_a_mask_past_its_row():
    kernels = load_native_attention()
    q = torch.zeros(1, 2, 16)
    cache = torch.zeros(2, 4, 2, 16)
    with pytest.raises(ValueError, match="tree mask"):
        kernels.decode(q, cache, cache, torch.tensor([[0, 1]], dtype=torch.int32),
                       torch.tensor([3], dtype=torch.int32), 0.25, tree_masks=torch.tensor([0b1000], dtype=torch.int64))
