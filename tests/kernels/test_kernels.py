"""The Triton kernels against their torch references, and the references against a naive
dense causal attention.

On CPU the kernels run in Triton's interpreter. With RADIXSERVE_TEST_DEVICE=cuda they
are compiled and run on the GPU (bench/gpu_check.sh does that).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from radixserve.kernels.triton import configure_triton  # imports no triton

DEVICE = torch.device(os.environ.get("RADIXSERVE_TEST_DEVICE", "cpu"))
configure_triton(DEVICE)  # before triton's first import
pytest.importorskip("triton")

from radixserve.kernels.triton.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from radixserve.kernels.triton.extend_attention import extend_attention, extend_attention_reference  # noqa: E402
from radixserve.kernels.triton.store_kv import store_kv, store_kv_reference  # noqa: E402

TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
# (num query heads, num kv heads): query/KV head ratios 1, 3 and 4.
HEADS = [(2, 2), (3, 1), (8, 2)]


# ---- paged scenarios ------------------------------------------------------------------


@dataclass
class Paged:
    """Requests' dense K/V contexts written into a shuffled, noise-filled paged pool.

    The tables of the requests marked in `sharing` (default: all) start with the same
    `shared_blocks` physical blocks, as prefix-cache hits do, so those requests' first
    tokens are identical. Padding entries are 0.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    dense_k: list[torch.Tensor]  # per request [seq_len, kv_heads, head_dim]
    dense_v: list[torch.Tensor]


def _randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


def build_paged(
    context_lens: list[int], *, kv_heads: int, head_dim: int, block_size: int, shared_blocks: int,
    dtype: torch.dtype, sharing: list[bool] | None = None, seed: int = 0,
) -> Paged:
    g = torch.Generator().manual_seed(seed)
    sharing = sharing or [True] * len(context_lens)
    shared_dense = [_randn(g, shared_blocks * block_size, kv_heads, head_dim) for _ in range(2)]
    shared_counts = [min(shared_blocks, -(-n // block_size)) if s else 0 for n, s in zip(context_lens, sharing)]
    own_counts = [-(-n // block_size) - c for n, c in zip(context_lens, shared_counts)]
    num_blocks = shared_blocks + sum(own_counts) + 3
    physical = torch.randperm(num_blocks, generator=g).tolist()
    shared_ids, next_free = physical[:shared_blocks], shared_blocks
    tables: list[list[int]] = []
    for used_shared, own in zip(shared_counts, own_counts):
        tables.append(shared_ids[:used_shared] + physical[next_free : next_free + own])
        next_free += own
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    k_cache = _randn(g, num_blocks, block_size, kv_heads, head_dim)  # noise where nothing is written
    v_cache = _randn(g, num_blocks, block_size, kv_heads, head_dim)
    dense_k, dense_v = [], []
    for n, table, used_shared in zip(context_lens, tables, shared_counts):
        shared_tokens = min(n, used_shared * block_size)
        ks = torch.cat([shared_dense[0][:shared_tokens], _randn(g, n - shared_tokens, kv_heads, head_dim)])
        vs = torch.cat([shared_dense[1][:shared_tokens], _randn(g, n - shared_tokens, kv_heads, head_dim)])
        for pos in range(n):
            k_cache[table[pos // block_size], pos % block_size] = ks[pos]
            v_cache[table[pos // block_size], pos % block_size] = vs[pos]
        dense_k.append(ks.to(dtype))
        dense_v.append(vs.to(dtype))
    return Paged(
        k_cache.to(dtype).to(DEVICE), v_cache.to(dtype).to(DEVICE), block_tables.to(DEVICE),
        torch.tensor(context_lens, dtype=torch.int32, device=DEVICE), dense_k, dense_v,
    )


def naive_causal_attention(q, keys, values, positions, scale):
    """Float64, loop per head and query row: q [t, Hq, D] at context positions `positions`
    over dense keys/values [L, Hkv, D]."""
    group = q.shape[1] // keys.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(q.shape[1]):
        for row, pos in enumerate(positions):
            k = keys[: pos + 1, h // group].double()
            scores = (k @ q[row, h].double()) * scale
            weights = torch.exp(scores - scores.max())
            out[row, h] = (weights / weights.sum()) @ values[: pos + 1, h // group].double()
    return out


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOLERANCE[dtype])


def _query(num_tokens, num_heads, head_dim, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return _randn(g, num_tokens, num_heads, head_dim).to(dtype).to(DEVICE)


# ---- store_kv ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_store_kv_matches_reference(dtype, block_size):
    g = torch.Generator().manual_seed(0)
    num_blocks, kv_heads, head_dim = 8, 3, 64
    caches = [_randn(g, num_blocks, block_size, kv_heads, head_dim).to(dtype).to(DEVICE) for _ in range(2)]
    expected = [c.clone() for c in caches]
    # k and v as strided views of a fused projection output, as the model produces them.
    fused = _randn(g, 6, 2 * kv_heads + 1, head_dim).to(dtype).to(DEVICE)
    k, v = fused[:, :kv_heads], fused[:, kv_heads + 1 :]
    slots = torch.tensor([0, 5, num_blocks * block_size - 1, -1, 3 * block_size, 2], device=DEVICE)
    store_kv(k, v, *caches, slots)
    store_kv_reference(k, v, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_store_kv_rejects_mismatched_dtype():
    cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    k = torch.zeros(1, 1, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="dtype"):
        store_kv(k, k, cache, cache.clone(), torch.zeros(1, dtype=torch.int64, device=DEVICE))


# ---- decode -----------------------------------------------------------------------------


def _decode_case(heads, head_dim, block_size, dtype, context_lens, shared_blocks):
    num_heads, kv_heads = heads
    paged = build_paged(context_lens, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                        shared_blocks=shared_blocks, dtype=dtype)
    return paged, _query(len(context_lens), num_heads, head_dim, dtype)


def _decode_contexts(block_size):
    """Length 1, exactly a block multiple, ragged lengths, and one over the 32-token
    interpreter tile (so several tiles for block size 1 as well)."""
    return [1, 2 * block_size, 3 * block_size + 5, block_size + 1, 40]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_matches_reference_fp32(heads, head_dim, block_size):
    shared_blocks = 2 if block_size > 1 else 24
    paged, q = _decode_case(heads, head_dim, block_size, torch.float32, _decode_contexts(block_size), shared_blocks)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, head_dim**-0.5)
    assert_close(decode_attention(*args), decode_attention_reference(*args), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_matches_reference_half(dtype):
    paged, q = _decode_case((8, 2), 64, 16, dtype, [1, 32, 45], 1)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.125)
    assert_close(decode_attention(*args), decode_attention_reference(*args), dtype)


@pytest.mark.parametrize("num_splits", [4, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_split_k_matches_reference(num_splits, dtype):
    # One long context (several tiles per split), short ones whose later splits are empty.
    paged, q = _decode_case((4, 1), 64, 16, dtype, [300, 1, 37], 2)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.125)
    expected = decode_attention_reference(*args)
    assert_close(decode_attention(*args, num_splits=num_splits), expected, dtype)
    assert_close(decode_attention(*args, num_splits=1), expected, dtype)


def test_decode_writes_into_strided_out():
    paged, q = _decode_case((3, 1), 64, 4, torch.float32, [9, 4], 1)
    buffer = torch.zeros(2, 5, 64, device=DEVICE)
    out = buffer[:, 1:4]
    decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.125, out=out)
    expected = decode_attention_reference(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.125)
    assert_close(out, expected, torch.float32)
    assert buffer[:, 0].abs().sum() == 0 and buffer[:, 4].abs().sum() == 0


def test_decode_rejects_int64_block_tables():
    paged, q = _decode_case((2, 2), 64, 4, torch.float32, [3], 0)
    with pytest.raises(ValueError, match="block_tables"):
        decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables.long(), paged.seq_lens, 0.125)


def test_decode_reference_matches_naive_attention():
    paged, q = _decode_case((8, 2), 16, 4, torch.float32, [1, 8, 13, 22], 2)
    out = decode_attention_reference(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.25)
    for i, n in enumerate(paged.seq_lens.tolist()):
        expected = naive_causal_attention(q[i : i + 1].cpu(), paged.dense_k[i], paged.dense_v[i], [n - 1], 0.25)
        torch.testing.assert_close(out[i : i + 1].double().cpu(), expected, atol=1e-5, rtol=1e-5)


# ---- extend -----------------------------------------------------------------------------


@dataclass
class ExtendCase:
    paged: Paged
    q: torch.Tensor
    query_start_loc: torch.Tensor
    query_lens: list[int]

    def args(self, scale):
        p = self.paged
        return (self.q, p.k_cache, p.v_cache, p.block_tables, self.query_start_loc, p.seq_lens, scale)


def _extend_case(heads, head_dim, block_size, dtype, shared_blocks=2, leading_rows=0):
    """Three chunks: prefix entirely cached (the shared blocks), prefix partly cached
    (shared blocks plus its own earlier, unaligned tokens), no prefix at all. Chunks are
    longer than the interpreter's 16-row tile. `leading_rows` puts unrelated q rows first."""
    num_heads, kv_heads = heads
    cached = shared_blocks * block_size
    query_lens = [5, 18, 20]
    context_lens = [cached + 5, cached + 3 + 18, 20]
    paged = build_paged(context_lens, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                        shared_blocks=shared_blocks, dtype=dtype, sharing=[True, True, False])
    starts = [leading_rows]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = _query(starts[-1], num_heads, head_dim, dtype)
    return ExtendCase(paged, q, torch.tensor(starts, dtype=torch.int32, device=DEVICE), query_lens)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16])
def test_extend_matches_reference_fp32(heads, head_dim, block_size):
    case = _extend_case(heads, head_dim, block_size, torch.float32, shared_blocks=2 if block_size > 1 else 20)
    args = case.args(head_dim**-0.5)
    assert_close(extend_attention(*args), extend_attention_reference(*args), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_extend_matches_reference_half(dtype):
    case = _extend_case((8, 2), 64, 16, dtype)
    args = case.args(0.125)
    assert_close(extend_attention(*args), extend_attention_reference(*args), dtype)


def test_extend_leaves_other_rows_alone():
    case = _extend_case((4, 2), 64, 4, torch.float32, leading_rows=3)
    out = torch.full_like(case.q, 7.0)
    extend_attention(*case.args(0.125), max_query_len=max(case.query_lens), out=out)
    expected = extend_attention_reference(*case.args(0.125), out=torch.full_like(case.q, 7.0))
    assert_close(out, expected, torch.float32)
    assert (out[:3] == 7.0).all()


def test_extend_reference_matches_naive_attention():
    case = _extend_case((8, 2), 16, 4, torch.float32)
    out = extend_attention_reference(*case.args(0.25))
    starts = case.query_start_loc.tolist()
    for i, n in enumerate(case.paged.seq_lens.tolist()):
        rows = slice(starts[i], starts[i + 1])
        positions = list(range(n - case.query_lens[i], n))
        expected = naive_causal_attention(case.q[rows].cpu(), case.paged.dense_k[i], case.paged.dense_v[i], positions, 0.25)
        torch.testing.assert_close(out[rows].double().cpu(), expected, atol=1e-5, rtol=1e-5)


def test_extend_scenario_shares_physical_blocks():
    tables = _extend_case((2, 2), 16, 4, torch.float32).paged.block_tables.tolist()
    assert tables[0][:2] == tables[1][:2]
    assert not set(tables[0][:2]) & set(tables[2][:5])  # the prefix-less request owns all its blocks


# ---- int8 pages (kernels/quantized_pages.py; fp8 pages: test_kv_fp8.py) ---------------------


def _quantized_views(paged: Paged, code_name: str = "int8"):
    """The paged case's K/V quantized into pages of that code: (k codes, v codes, k scales,
    v scales), strided views of the pages as the triton backend hands them to the kernels,
    and the pages dequantized ([blocks, block_size, kv_heads, head_dim] float64)."""
    from radixserve.kernels.quantized_pages import PAGE_CODES, QuantizedPages

    num_blocks, block_size, kv_heads, head_dim = paged.k_cache.shape
    pages = QuantizedPages(block_size, kv_heads, head_dim, PAGE_CODES[code_name])
    raw = [torch.zeros(num_blocks, pages.page_bytes, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    flat = [c.float().reshape(-1, kv_heads, head_dim) for c in (paged.k_cache, paged.v_cache)]
    pages.store(*flat, *raw, torch.arange(num_blocks * block_size, device=DEVICE))
    views = (pages.codes(raw[0]), pages.codes(raw[1]), pages.scales(raw[0]), pages.scales(raw[1]))
    return views, [pages.read(r, torch.float64) for r in raw]


def _float64_rows(q, dequantized, block_tables, seq_lens, query_starts, scale):
    """Each request's query rows (the last ones of its context) in float64 over the dequantized pages."""
    from radixserve.kernels.triton.decode_attention import gather_context

    out = []
    for i, n in enumerate(seq_lens.tolist()):
        start, end = query_starts[i], query_starts[i + 1]
        keys, values = (gather_context(c, block_tables[i].cpu(), n) for c in dequantized)
        out.append(naive_causal_attention(q[start:end].cpu(), keys.cpu(), values.cpu(), range(n - (end - start), n), scale))
    return torch.cat(out)


def _store_quantized(pages, num_blocks: int, tiny_token: bool = False):
    """7 tokens' strided K/V rows (the third not stored; with tiny_token the second's K 1e5
    times smaller) stored into zeroed pages by store_kv and by store_kv_reference: both
    results as (k codes, v codes, k scales, v scales) views of the pages."""
    g = torch.Generator().manual_seed(3)
    kv_heads, head_dim = pages.num_kv_heads, pages.head_dim
    fused = (_randn(g, 7, 2 * kv_heads + 1, head_dim) * 4).to(DEVICE)
    k, v = fused[:, :kv_heads], fused[:, kv_heads + 1 :]
    if tiny_token:
        k[1] *= 1e-5
    slots = torch.randperm(num_blocks * pages.block_size, generator=g)[:7].to(DEVICE)
    slots[2] = -1  # not stored
    results = []
    for store in (store_kv, store_kv_reference):
        raw = [torch.zeros(num_blocks, pages.page_bytes, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
        views = (pages.codes(raw[0]), pages.codes(raw[1]), pages.scales(raw[0]), pages.scales(raw[1]))
        store(k, v, views[0], views[1], slots, k_scales=views[2], v_scales=views[3])
        results.append(views)
    return results


@pytest.mark.parametrize("block_size, kv_heads", [(1, 2), (5, 1), (16, 3)])
def test_store_kv_int8_matches_reference(block_size, kv_heads):
    from radixserve.kernels.quantized_pages import QuantizedPages

    g_views, w_views = _store_quantized(QuantizedPages(block_size, kv_heads, 64), 9)
    for a, b in zip(g_views[:2], w_views[:2]):
        assert (a.int() - b.int()).abs().max() <= 1  # rounding ties only
    for a, b in zip(g_views[2:], w_views[2:]):
        torch.testing.assert_close(a, b, atol=0, rtol=1e-6)
    assert int(w_views[2].count_nonzero()) == 6 * kv_heads  # every stored token's heads, nothing else


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_int8_matches_float64(heads, block_size, num_splits):
    paged, q = _decode_case(heads, 64, block_size, torch.float32, _decode_contexts(block_size), 2)
    (k_codes, v_codes, k_scales, v_scales), dequantized = _quantized_views(paged)
    out = decode_attention(q, k_codes, v_codes, paged.block_tables, paged.seq_lens, 0.125, num_splits=num_splits,
                           k_scales=k_scales, v_scales=v_scales)
    starts = list(range(q.shape[0] + 1))
    expected = _float64_rows(q, dequantized, paged.block_tables, paged.seq_lens, starts, 0.125)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_extend_int8_matches_float64(heads, block_size):
    case = _extend_case(heads, 64, block_size, torch.float32, shared_blocks=2 if block_size > 1 else 20)
    p = case.paged
    (k_codes, v_codes, k_scales, v_scales), dequantized = _quantized_views(p)
    out = extend_attention(case.q, k_codes, v_codes, p.block_tables, case.query_start_loc, p.seq_lens, 0.125,
                           k_scales=k_scales, v_scales=v_scales)
    expected = _float64_rows(case.q, dequantized, p.block_tables, p.seq_lens, case.query_start_loc.tolist(), 0.125)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)


def test_int8_kernels_refuse_missing_or_misshapen_scales():
    paged, q = _decode_case((2, 2), 64, 4, torch.float32, [3], 0)
    (k_codes, v_codes, k_scales, v_scales), _ = _quantized_views(paged)
    with pytest.raises(ValueError, match="both k_scales and v_scales"):
        decode_attention(q, k_codes, v_codes, paged.block_tables, paged.seq_lens, 0.125, k_scales=k_scales)
    with pytest.raises(ValueError, match="k_scales must be float32"):
        decode_attention(q, k_codes, v_codes, paged.block_tables, paged.seq_lens, 0.125,
                         k_scales=k_scales[:, :2], v_scales=v_scales)
