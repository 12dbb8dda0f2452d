"""The cpu and torch attention backends, and the C kernels under the cpu one, against a
dense float64 reference on paged pools where neighbouring requests share prefix blocks;
the registry's choice between them; whole generations with each."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.attention import registry
from radixserve.attention.cpu_backend import CpuAttentionBackend, CpuPlan
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.torch_backend import TorchAttentionBackend, TorchPlan, store_kv
from radixserve.kernels.quantized_pages import QuantizedPages
from radixserve.kernels.native_attention import load_native_attention
from attention_reference import dense_reference

native = load_native_attention()
needs_native = pytest.mark.skipif(native is None, reason="no C compiler here")
BACKENDS = [TorchAttentionBackend, pytest.param(CpuAttentionBackend, marks=needs_native)]


def build_case(lens, shared_prefix_blocks, *, heads, kv_heads, head_dim, block_size, seed=0):
    """Requests with context lengths `lens`; request i's table starts with the first
    shared_prefix_blocks[i] blocks of one common prefix (0: nothing shared)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = sum(-(-n // block_size) for n in lens) + max(shared_prefix_blocks) + 4
    free = list(range(needed))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(max(shared_prefix_blocks))]
    tables = []
    for n, shared in zip(lens, shared_prefix_blocks):
        blocks = -(-n // block_size)
        assert shared * block_size <= n
        tables.append(prefix[:shared] + [free.pop() for _ in range(blocks - shared)])
    width = max(len(t) for t in tables)
    k_cache = torch.randn(needed, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(needed, block_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32)




CASES = [
    # lens, shared blocks per request (neighbours with equal counts share those blocks)
    ([37, 64, 65, 1, 200, 33, 130, 131, 3], [2, 2, 2, 0, 2, 2, 2, 2, 0]),
    ([17] * 20, [1] * 20),  # more sharers than one group holds
    ([80, 81, 79, 16, 95], [4, 4, 3, 1, 0]),  # sharers of different depths side by side
    ([5, 300, 2], [0, 0, 0]),  # nothing shared
]


@needs_native
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_native_decode_matches_dense_reference(heads, kv_heads, head_dim, block_size, case):
    lens, shared = CASES[case]
    shared = [min(s, n // block_size) if s else 0 for s, n in zip(shared, lens)]
    args = build_case(lens, shared, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    scale = head_dim**-0.5
    got = native.decode(*args, scale)
    torch.testing.assert_close(got, dense_reference(*args, scale), atol=2e-5, rtol=2e-5)


def request_rows(requests, *, heads, kv_heads, head_dim, block_size, int8=False, seed=0):
    """Query rows laid out as the runner lays out a verify step or a small prompt chunk:
    requests is a list of (context, rows, table of a request it forks from or None, blocks
    shared with it); a request's rows are consecutive, share its block table, and row i of
    r sees the context up to context - r + 1 + i (causal offsets). Returns the decode
    kernel's arguments, then `pages` (or None) and the caches as floats for the reference."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    needed = sum(-(-n // block_size) for n, *_ in requests) + 2
    free = list(range(needed))
    rng.shuffle(free)
    tables, row_tables, lens = [], [], []
    for context, rows, parent, shared in requests:
        head = tables[parent][:shared] if parent is not None else []
        table = head + [free.pop() for _ in range(-(-context // block_size) - len(head))]
        tables.append(table)
        row_tables += [table] * rows
        lens += [context - rows + 1 + i for i in range(rows)]
    width = max(len(t) for t in row_tables)
    k = torch.randn(needed, block_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(needed, block_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in row_tables], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if not int8:
        return (q, k, v, block_tables, seq_lens), None, k, v
    pages = QuantizedPages(block_size, kv_heads, head_dim)
    k_pages, v_pages = (torch.zeros(needed, pages.page_bytes, dtype=torch.uint8) for _ in range(2))
    pages.store(k.flatten(0, 1), v.flatten(0, 1), k_pages, v_pages, torch.arange(needed * block_size))
    return (q, k_pages, v_pages, block_tables, seq_lens), pages, pages.read(k_pages, torch.float32), \
        pages.read(v_pages, torch.float32)


ROW_CASES = [
    [(37, 5, None, 0)],  # a verify step: 5 rows, the last blocks partial
    [(64, 4, None, 0), (1, 1, None, 0), (33, 8, None, 0)],  # rows cross a block boundary; a lone decode
    [(150, 70, None, 0)],  # a small prompt chunk: more rows than one group holds
    [(7, 7, None, 0), (200, 3, None, 0), (211, 6, 1, 9)],  # a fresh prompt; a fork sharing 9 blocks, then its own
]


@needs_native
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 2), (2, 2)])
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (40, 5), (128, 16)])
@pytest.mark.parametrize("case", range(len(ROW_CASES)))
def test_native_decode_of_several_rows_per_request_matches_float64(int8, heads, kv_heads, head_dim, block_size, case):
    requests = [(n, rows, parent, min(shared, -(-n // block_size) - 1)) for n, rows, parent, shared in ROW_CASES[case]]
    args, pages, k, v = request_rows(requests, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                     block_size=block_size, int8=int8, seed=case)
    scale = head_dim**-0.5
    got = native.decode(*args, scale, pages)
    q, _, _, tables, seq_lens = args
    torch.testing.assert_close(got, dense_reference(q, k, v, tables, seq_lens, scale), atol=3e-5, rtol=3e-5)


@needs_native
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (9, 3), (4, 4), (4, 1)])
def test_native_decode_splits_kv_heads_between_threads_when_requests_are_fewer(int8, heads, kv_heads):
    """A decode of fewer request groups than threads (a batch of one) gives each thread a share of
    the KV heads: every head computed once, the same bits at every thread count, float64's values."""
    previous = torch.get_num_threads()
    try:
        for case, requests in enumerate(([(150, 1, None, 0)], [(37, 5, None, 0)], [(64, 1, None, 0), (9, 1, None, 0)])):
            args, pages, k, v = request_rows(requests, heads=heads, kv_heads=kv_heads, head_dim=64, block_size=16,
                                             int8=int8, seed=case)
            outs = []
            for threads in (1, 2, 3, 4):
                torch.set_num_threads(threads)
                outs.append(native.decode(*args, 0.125, pages))
            q, _, _, tables, seq_lens = args
            torch.testing.assert_close(outs[0], dense_reference(q, k, v, tables, seq_lens, 0.125), atol=3e-5, rtol=3e-5)
            for out in outs[1:]:
                assert torch.equal(out, outs[0]), case
    finally:
        torch.set_num_threads(previous)


@needs_native
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("window, sinks", [(0, False), (300, False), (0, True)], ids=["full", "window", "sinks"])
def test_native_decode_of_a_long_context_is_the_same_alone_in_a_batch_and_at_any_thread_count(int8, window, sinks):
    """A long context is folded in fixed chunks, spread over the threads when the batch is small
    and walked whole by one thread when it is not: a row's output has the same bits alone, in a
    batch of nine, and at 1-3 threads, and float64's values."""
    contexts = [1000, 37, 700, 129, 128, 5, 260, 999, 64]
    args, pages, k, v = request_rows([(n, 1, None, 0) for n in contexts], heads=9, kv_heads=3, head_dim=64,
                                     block_size=16, int8=int8, seed=7)
    q, k_pages, v_pages, tables, seq_lens = args
    logits = torch.randn(9, generator=torch.Generator().manual_seed(1)) if sinks else None
    previous = torch.get_num_threads()
    try:
        outs = {}
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs[threads] = native.decode(*args, 0.125, pages, window=window, sinks=logits)
            for i in range(len(contexts)):
                alone = native.decode(q[i:i + 1], k_pages, v_pages, tables[i:i + 1], seq_lens[i:i + 1], 0.125, pages,
                                      window=window, sinks=logits)
                assert torch.equal(alone[0], outs[threads][i]), (threads, contexts[i])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outs[1], outs[2]) and torch.equal(outs[1], outs[3])
    want = dense_reference(q, k, v, tables, seq_lens, 0.125, window=window, sinks=logits)
    torch.testing.assert_close(outs[1], want, atol=3e-5, rtol=3e-5)


@needs_native
def test_native_decode_block_size_one_and_unsorted_sharers():
    lens = [9, 12, 9, 30, 12]
    args = build_case(lens, [8, 0, 8, 8, 0], heads=6, kv_heads=2, head_dim=24, block_size=1, seed=3)
    got = native.decode(*args, 0.3)
    torch.testing.assert_close(got, dense_reference(*args, 0.3), atol=2e-5, rtol=2e-5)


@needs_native
def test_native_decode_rejects_wrong_dtypes():
    q, k_cache, v_cache, tables, lens = build_case([20], [0], heads=2, kv_heads=1, head_dim=8, block_size=4)
    with pytest.raises(ValueError, match="block_tables"):
        native.decode(q, k_cache, v_cache, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="q must be"):
        native.decode(q.double(), k_cache, v_cache, tables, lens, 1.0)


@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_native_store_writes_exactly_the_slots(tokens):
    if native is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(tokens)
    k_cache = torch.randn(40, 16, 3, 8, generator=gen)
    v_cache = torch.randn(40, 16, 3, 8, generator=gen)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(40 * 16, generator=gen)[:tokens]
    k, v = torch.randn(tokens, 3, 8, generator=gen), torch.randn(tokens, 3, 8, generator=gen)
    store_kv(k, v, want_k, want_v, slots)  # the pure-torch path
    assert native.store(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_native_store_declines_what_it_cannot_do():
    if native is None:
        pytest.skip("no C compiler here")
    cache = torch.zeros(4, 4, 1, 8)
    k = torch.ones(2, 1, 8)
    assert not native.store(k, k, cache, cache.clone(), torch.tensor([0, 1], dtype=torch.int32))
    assert not native.store(k.double(), k.double(), cache, cache.clone(), torch.tensor([0, 1]))
    assert not native.store(k, k, cache, cache.clone(), torch.tensor([0, 1, 2]))  # slots vs rows
    assert cache.abs().sum() == 0


def fused_rows(*parts: torch.Tensor) -> list[torch.Tensor]:
    """Each [T, heads, d] part again as a view of one fused [T, sum] row (as q, k and v are
    views of the qkv projection's rows): token rows strided, heads dense."""
    fused = torch.cat([p.flatten(1) for p in parts], 1)
    views, at = [], 0
    for p in parts:
        views.append(fused[:, at : at + p[0].numel()].view(p.shape))
        at += p[0].numel()
    return views


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_native_store_takes_views_of_fused_rows(int8):
    if native is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(3)
    pages = QuantizedPages(16, 3, 8) if int8 else None
    cache = torch.zeros(40, pages.page_bytes, dtype=torch.uint8) if int8 else torch.zeros(40, 16, 3, 8)
    slots = torch.randperm(40 * 16, generator=gen)[:50]
    k, v = torch.randn(50, 3, 8, generator=gen), torch.randn(50, 3, 8, generator=gen)
    _, k_view, v_view = fused_rows(torch.randn(50, 4, 8, generator=gen), k, v)
    dense = [cache.clone(), cache.clone()]
    strided = [cache.clone(), cache.clone()]
    assert native.store(k, v, *dense, slots, pages)
    assert native.store(k_view, v_view, *strided, slots, pages)
    assert torch.equal(dense[0], strided[0]) and torch.equal(dense[1], strided[1])
    assert not native.store(k_view, v.contiguous(), *strided, slots, pages)  # rows apart unlike


def test_native_prefill_reads_q_rows_strided():
    """q as a view of the fused qkv rows: the same bits as q made contiguous (int8 pages:
    test_sliding_window's backend steps)."""
    if native is None:
        pytest.skip("no C compiler here")
    q, k_cache, v_cache, *rest = build_chunks([(301, 144, 0), (90, 34, 0)], heads=4, kv_heads=1, head_dim=64,
                                              block_size=16, seed=5)
    q_view = fused_rows(q, torch.randn(q.shape[0], 2, 64))[0]
    dense, strided = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    native.prefill(q, k_cache, v_cache, *rest, 0.125, dense)
    native.prefill(q_view, k_cache, v_cache, *rest, 0.125, strided)
    assert torch.equal(dense, strided)
    with pytest.raises(ValueError, match="contiguous"):  # heads not dense within a row
        native.prefill(q.transpose(0, 1).contiguous().transpose(0, 1), k_cache, v_cache, *rest, 0.125, strided)


def test_native_kernels_reject_out_of_range_input_without_touching_memory():
    if native is None:
        pytest.skip("no C compiler here")
    q, k_cache, v_cache, tables, lens = build_case([20, 7], [0, 0], heads=4, kv_heads=2, head_dim=8, block_size=4)
    bad_block = tables.clone()
    bad_block[1, 0] = k_cache.shape[0]  # one past the pool
    with pytest.raises(ValueError, match="block id"):
        native.decode(q, k_cache, v_cache, bad_block, lens, 1.0)
    with pytest.raises(ValueError, match="context length"):
        native.decode(q, k_cache, v_cache, tables, torch.tensor([20, 0], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="context length"):  # longer than its table row covers
        native.decode(q, k_cache, v_cache, tables, torch.tensor([20, 4 * tables.shape[1] + 1], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        native.decode(q[:, :3].contiguous(), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="one row per query"):
        native.decode(q, k_cache, v_cache, tables[:1], lens, 1.0)
    before = k_cache.clone()
    k = torch.ones(2, 2, 8)
    with pytest.raises(ValueError, match="outside the pool"):
        native.store(k, k, k_cache, v_cache, torch.tensor([0, k_cache.shape[0] * 4]))
    assert torch.equal(k_cache, before)


# ---- the tiled prefill kernel: prompt chunks over the pool ---------------------------------


def build_chunks(chunks, *, heads, kv_heads, head_dim, block_size, seed=0):
    """Prompt chunks (context after the step, new tokens, blocks shared with the chunk
    before) in one step's q: rows from 1 on (row 0 and the last are another request's),
    their K/V already in the pool. Returns q, caches, tables, query_start, seq_lens."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n, _, _ in chunks) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for context, _, shared in chunks:
        own = [free.pop() for _ in range(-(-context // block_size) - shared)]
        tables.append((tables[-1][:shared] if shared else []) + own)
    starts = [1]
    for _, new, _ in chunks:
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(starts[-1] + 1, heads, head_dim, generator=gen)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return (q, k_cache, v_cache, block_tables, torch.tensor(starts, dtype=torch.int32),
            torch.tensor([n for n, _, _ in chunks], dtype=torch.int32))


def chunks_reference(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale, out):
    """Each chunk's rows of out, in float64: row r of n new tokens sees context - n + r + 1 keys."""
    group, block_size = q.shape[1] // k_cache.shape[2], k_cache.shape[1]
    for c, context in enumerate(seq_lens.tolist()):
        start, end = query_start[c].item(), query_start[c + 1].item()
        blocks = block_tables[c, : -(-context // block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[:context].double().repeat_interleave(group, 1)
        values = v_cache[blocks].flatten(0, 1)[:context].double().repeat_interleave(group, 1)
        scores = torch.einsum("rhd,thd->hrt", q[start:end].double(), keys) * scale
        visible = torch.arange(context)[None, :] <= torch.arange(end - start)[:, None] + context - (end - start)
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hrt,thd->rhd", weights, values).float()
    return out


PREFILL_CASES = [
    # (context after the step, new tokens, leading blocks shared with the chunk before)
    [(37, 37, 0)],  # a whole odd-length prompt, its last block partial
    [(1, 1, 0), (2, 2, 0), (3, 1, 0)],  # tiny chunks
    [(200, 13, 0), (65, 64, 0), (130, 129, 0)],  # extends that start inside a block
    [(301, 300, 0), (700, 237, 0)],  # past one tile of keys and one item of query rows
    [(96, 40, 0), (90, 34, 3)],  # two requests sharing a cached prefix, extended apart
]


@needs_native
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 2, 40), (4, 4, 16), (2, 1, 128), (6, 2, 24)])
@pytest.mark.parametrize("block_size", [16, 5, 1])
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_native_prefill_matches_dense_reference(heads, kv_heads, head_dim, block_size, case):
    chunks = [(n, new, min(shared, (n - new) // block_size) if shared else 0) for n, new, shared in PREFILL_CASES[case]]
    if block_size == 1:
        chunks = [(n, new, shared * 5) for n, new, shared in chunks]  # the same tokens shared
    args = build_chunks(chunks, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, seed=case)
    scale = head_dim**-0.5
    out = torch.full_like(args[0], 7.0)
    native.prefill(*args, scale, out)
    want = chunks_reference(*args, scale, torch.full_like(args[0], 7.0))
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)  # rows of other requests untouched


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_prefill_splits_small_chunks_across_threads(threads):
    """A step of fewer items than threads (one KV head) splits its chunks' rows evenly into an
    item per thread where each keeps 8 positions or more: every row still computed, once."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for chunks in ([(301, 1, 0)], [(315, 15, 0)], [(316, 16, 0)], [(340, 40, 0)], [(97, 97, 0)],
                       [(305, 5, 0), (360, 60, 0)], [(400, 200, 0), (150, 150, 0)]):
            args = build_chunks(chunks, heads=4, kv_heads=1, head_dim=64, block_size=16, seed=len(chunks))
            out = torch.full_like(args[0], 7.0)
            native.prefill(*args, 0.125, out)
            want = chunks_reference(*args, 0.125, torch.full_like(args[0], 7.0))
            torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    finally:
        torch.set_num_threads(previous)


@needs_native
@pytest.mark.parametrize("block_size", [16, 5])
def test_native_prefill_follows_scores_that_jump_across_tiles(block_size):
    """Scores rising by less than the kernel's rescale slack (its running max may trail), by
    far more (it must move), then falling and rising again, tile after tile: still float64's
    softmax, with no overflow on the way."""
    heads, kv_heads, head_dim, context = 9, 3, 64, 6 * 64 + 7
    args = build_chunks([(context, context - 3, 0)], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                        block_size=block_size, seed=3)
    q, k_cache, _, block_tables = args[:4]
    gen = torch.Generator().manual_seed(4)
    direction = torch.nn.functional.normalize(torch.randn(head_dim, generator=gen), dim=0)
    q.mul_(0.05).add_(4 * direction)
    steps = [0.0, 8.0, 40.0, 80.0, -60.0, 30.0, 250.0]  # q.k / sqrt(d) ~ step / 2 in each 64-key tile
    blocks = block_tables[0].long()
    for t in range(context):
        row = k_cache[blocks[t // block_size], t % block_size]
        row.mul_(0.05).add_(steps[t // 64] * direction)
    scale = head_dim**-0.5
    out = torch.full_like(q, 7.0)
    native.prefill(*args, scale, out)
    want = chunks_reference(*args, scale, torch.full_like(q, 7.0))
    assert torch.isfinite(out).all()
    # scores of ~125 carry float32 rounding of ~1e-5 into the weights; a wrong rescale is off by O(1)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


needs_bf16 = pytest.mark.skipif(native is None or not native.has_bf16_prefill(64),
                                reason="no AVX512_BF16 on this CPU (or no C compiler)")
LOG2E = 1.4426950408889634


def bf16_rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def bf16_inputs_reference(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale):
    """What the bf16 path computes before its weights are rounded: float64 attention of q
    (pre-scaled into log2 units, as the kernel scales it), k and v each rounded to bf16."""
    q_rounded = (bf16_rounded(q * (scale * LOG2E)).double() / LOG2E).float()
    return chunks_reference(q_rounded, bf16_rounded(k_cache), bf16_rounded(v_cache), block_tables, query_start,
                            seq_lens, 1.0, torch.full_like(q, 7.0))


@needs_bf16
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (2, 1, 128), (4, 4, 32)])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_native_prefill_with_bf16_dots_matches_bf16_inputs(heads, kv_heads, head_dim, block_size, case):
    """bf16 dot products: float64's attention of the bf16-rounded q, k and v, up to the kernel's
    own rounding of each weight to bf16 (2^-9 of it); rows of other requests untouched. The
    float32 path's result is ~1e-6 from exact, this one measurably farther: the flag reaches it."""
    chunks = [(n, new, min(shared, (n - new) // block_size) if shared else 0) for n, new, shared in PREFILL_CASES[case]]
    args = build_chunks(chunks, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, seed=case)
    scale = head_dim**-0.5
    out, exact32 = torch.full_like(args[0], 7.0), torch.full_like(args[0], 7.0)
    native.prefill(*args, scale, out, None, True)
    native.prefill(*args, scale, exact32)
    torch.testing.assert_close(out, bf16_inputs_reference(*args, scale), atol=6e-3, rtol=1e-2)
    assert (out - exact32).abs().max() > 1e-3


@needs_bf16
@pytest.mark.parametrize("block_size", [16, 5])
def test_native_prefill_with_bf16_dots_follows_scores_that_jump_across_tiles(block_size):
    """The running max's slack and rescales on the bf16 path: scores that rise, jump and fall
    tile after tile give the bf16-input softmax, finite throughout."""
    heads, kv_heads, head_dim, context = 9, 3, 64, 6 * 64 + 7
    args = build_chunks([(context, context - 3, 0)], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                        block_size=block_size, seed=3)
    q, k_cache, _, block_tables = args[:4]
    direction = torch.nn.functional.normalize(torch.randn(head_dim, generator=torch.Generator().manual_seed(4)), dim=0)
    q.mul_(0.05).add_(4 * direction)
    blocks = block_tables[0].long()
    for t in range(context):
        row = k_cache[blocks[t // block_size], t % block_size]
        row.mul_(0.05).add_([0.0, 8.0, 40.0, 80.0, -60.0, 30.0, 250.0][t // 64] * direction)
    out = torch.full_like(q, 7.0)
    native.prefill(*args, head_dim**-0.5, out, None, True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, bf16_inputs_reference(*args, head_dim**-0.5), atol=6e-3, rtol=1e-2)


@needs_native
def test_native_prefill_refuses_bf16_dots_it_cannot_take_without_writing():
    """head_dim 40 is no whole number of bf16 vector pairs (and a CPU without AVX512_BF16 takes
    none): a clear error, out untouched; the float32 path still takes the same call."""
    args = build_chunks([(37, 37, 0)], heads=4, kv_heads=2, head_dim=40, block_size=16)
    assert not native.has_bf16_prefill(40)
    out = torch.zeros_like(args[0])
    with pytest.raises(ValueError, match="AVX512_BF16 and a head_dim that is a multiple of 32"):
        native.prefill(*args, 40**-0.5, out, None, True)
    assert not out.any()
    native.prefill(*args, 40**-0.5, out)
    assert out[1:38].abs().sum() > 0


@needs_native
@pytest.mark.parametrize("flags", [["-mno-avx512f"], ["-mno-avx512f", "-mno-avx2", "-mno-fma"]])
def test_native_prefill_builds_for_each_vector_width(tmp_path, flags):
    """The tiled kernel is one source over vec.h's vectors: built here for AVX2 (8 lanes) and
    for plain floats (1), it computes what float64 does, scores that jump across tiles included."""
    import ctypes
    import shutil

    from radixserve.kernels import native_build

    compiler = shutil.which("cc") or shutil.which("gcc")
    library = tmp_path / "prefill.so"
    native_build._compile(compiler, native_build.CSRC / "prefill_attention.c", ["-fopenmp", *flags], library)
    fn = ctypes.CDLL(str(library)).paged_prefill_attention_f32
    signature = native_build.SIGNATURES["paged_prefill_attention_f32"]
    fn.argtypes, fn.restype = list(signature.argtypes), signature.restype
    for heads, kv_heads, head_dim, chunks in [(9, 3, 64, [(301, 300, 0), (700, 237, 0)]), (6, 2, 24, [(96, 40, 0)])]:
        q, k_cache, v_cache, tables, starts, lens = build_chunks(chunks, heads=heads, kv_heads=kv_heads,
                                                                  head_dim=head_dim, block_size=5, seed=head_dim)
        k_cache[tables[0, 20:30].long()] *= 12  # keys 100-149 of the first chunk: its rows' max must move
        out = torch.full_like(q, 7.0)
        assert fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], tables.data_ptr(),
                  tables.stride(0), tables.shape[1], starts.data_ptr(), lens.data_ptr(), lens.shape[0], q.shape[0],
                  out.data_ptr(), heads, kv_heads, head_dim, 5, head_dim**-0.5, 0, 0, None) == 0
        want = chunks_reference(q, k_cache, v_cache, tables, starts, lens, head_dim**-0.5, torch.full_like(q, 7.0))
        torch.testing.assert_close(out, want, atol=3e-5, rtol=3e-5)


@needs_native
def test_native_prefill_rejects_out_of_range_chunks_without_writing():
    q, k_cache, v_cache, tables, starts, lens = build_chunks([(20, 8, 0), (9, 9, 0)], heads=4, kv_heads=2,
                                                             head_dim=8, block_size=4)
    out = torch.zeros_like(q)
    cases = {
        "outside the pool": (tables.masked_fill(tables == tables[1, 0], k_cache.shape[0]), starts, lens),
        "longer than its context": (tables, starts, torch.tensor([20, 8], dtype=torch.int32)),
        "outside q": (tables, starts + 2, lens),
        "empty": (tables, torch.tensor([1, 1, 10], dtype=torch.int32), lens),
        "past its block table": (tables, starts, torch.tensor([20, 4 * tables.shape[1] + 1], dtype=torch.int32)),
    }
    for why, (t, s, n) in cases.items():
        with pytest.raises(ValueError, match="rows are empty"):
            native.prefill(q, k_cache, v_cache, t, s, n, 1.0, out)
        assert not out.any(), why
    with pytest.raises(ValueError, match="query_start"):
        native.prefill(q, k_cache, v_cache, tables, starts.long(), lens, 1.0, out)
    with pytest.raises(ValueError, match="like q"):
        native.prefill(q, k_cache, v_cache, tables, starts, lens, 1.0, out[:-1])


# ---- the backends: one whole step (store, decodes, prefill chunks) -------------------------


def mixed_step(requests, *, heads, kv_heads, head_dim, block_size, seed=0):
    """A step of requests (context after the step, new tokens, blocks shared with the common
    prefix, as many as fit before the new tokens), decodes first as the runner orders them.
    Returns metadata, q, k, v and a pool holding both layers' caches."""
    requests = [(n, new, min(shared, (n - new) // block_size)) for n, new, shared in requests]
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n, _, _ in requests) + 8
    free = list(range(num_blocks))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(max(s for _, _, s in requests))]
    requests = sorted(requests, key=lambda r: r[1] != 1)
    tables, starts, slots = [], [0], []
    for context, new, shared in requests:
        table = prefix[:shared] + [free.pop() for _ in range(-(-context // block_size) - shared)]
        tables.append(table)
        starts.append(starts[-1] + new)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(context - new, context)]
    width = max(len(t) for t in tables)
    seq_lens = [context for context, _, _ in requests]
    meta = AttentionMetadata(
        num_decodes=sum(1 for _, new, _ in requests if new == 1), block_size=block_size,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_list=starts, seq_lens_list=seq_lens,
    )
    tokens = starts[-1]
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=gen) for _ in range(2))
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    return meta, q, k, v, pool


def step_reference(meta, q, k_cache, v_cache, scale):
    """Every query row against its visible context (the pool already holds the step's
    K/V), in float64: row r of a chunk of q_len new tokens sees context - q_len + r + 1 keys."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    for i, context in enumerate(meta.seq_lens_list):
        start, end = meta.query_start_loc_list[i], meta.query_start_loc_list[i + 1]
        blocks = meta.block_tables[i, : -(-context // block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[:context].double().repeat_interleave(group, 1)
        values = v_cache[blocks].flatten(0, 1)[:context].double().repeat_interleave(group, 1)
        for r in range(end - start):
            visible = context - (end - start) + r + 1
            weights = (torch.einsum("hd,thd->ht", q[start + r].double(), keys[:visible]) * scale).softmax(-1)
            out[start + r] = torch.einsum("ht,thd->hd", weights, values[:visible]).float()
    return out


STEPS = [
    # (context after the step, new tokens, shared prefix blocks)
    [(37, 1, 2), (64, 1, 2), (65, 1, 2), (1, 1, 0), (200, 1, 2), (33, 1, 2)],  # decodes only
    [(9, 1, 1), (1, 1, 0), (40, 1, 2), (30, 6, 2), (35, 5, 1), (6, 6, 0)],  # decodes and all kinds of chunk
    [(20, 20, 0), (45, 13, 2)],  # prefill chunks only
]


@pytest.mark.parametrize("backend_class", BACKENDS)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 2, 40), (4, 4, 16)])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("step", range(len(STEPS)))
def test_backend_step_matches_dense_reference(backend_class, heads, kv_heads, head_dim, block_size, step):
    meta, q, k, v, pool = mixed_step(STEPS[step], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                     block_size=block_size, seed=step)
    want_pool = pool.clone()
    store_kv(k, v, want_pool[0], want_pool[1], meta.slot_mapping)
    backend = backend_class(heads, kv_heads, head_dim, head_dim**-0.5)
    plan = backend.prepare(meta)
    assert plan.num_decodes == meta.num_decodes
    first = backend.forward(q, k, v, pool[0], pool[1], plan)
    assert torch.equal(pool, want_pool), "the step's K/V went exactly into its slots"
    torch.testing.assert_close(first, step_reference(meta, q, pool[0], pool[1], head_dim**-0.5), atol=2e-5, rtol=2e-5)
    # The plan serves every layer of the step: a second layer's pool and K/V, same plan.
    q2, k2, v2 = q.flip(0).contiguous(), k.roll(1, 0).contiguous(), v.roll(1, 0).contiguous()
    pool2 = pool.flip(1).contiguous()
    second = backend.forward(q2, k2, v2, pool2[0], pool2[1], plan)
    torch.testing.assert_close(second, step_reference(meta, q2, pool2[0], pool2[1], head_dim**-0.5),
                               atol=2e-5, rtol=2e-5)


@needs_native
def test_cpu_backend_plans_for_its_kernels_and_runs_torch_paths_for_other_dtypes():
    meta, q, k, v, pool = mixed_step(STEPS[1], heads=6, kv_heads=2, head_dim=32, block_size=4)
    assert isinstance(CpuAttentionBackend(6, 2, 32, 0.2).prepare(meta), CpuPlan)
    q, k, v, pool = q.bfloat16(), k.bfloat16(), v.bfloat16(), pool.bfloat16()
    results = []
    for backend in (CpuAttentionBackend(6, 2, 32, 0.2, torch.bfloat16), TorchAttentionBackend(6, 2, 32, 0.2)):
        plan = backend.prepare(meta)
        assert isinstance(plan, TorchPlan)
        caches = pool.clone()
        results.append((backend.forward(q, k, v, caches[0], caches[1], plan), caches))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@needs_native
def test_cpu_backend_runs_prefill_chunks_tiled_or_on_sdpa_when_switched_off():
    meta, q, k, v, pool = mixed_step(STEPS[1], heads=6, kv_heads=2, head_dim=32, block_size=4, seed=5)
    results = {}
    for tiled in (True, False):
        backend = CpuAttentionBackend(6, 2, 32, 0.2, tiled_prefill=tiled)
        plan = backend.prepare(meta)
        assert (plan.tiled is not None, len(plan.prefills)) == ((True, 0) if tiled else (False, 3))
        caches = pool.clone()
        results[tiled] = backend.forward(q, k, v, caches[0], caches[1], plan)
    torch.testing.assert_close(results[True], results[False], atol=2e-5, rtol=2e-5)
    decodes_only = mixed_step(STEPS[0], heads=6, kv_heads=2, head_dim=32, block_size=4)[0]
    assert CpuAttentionBackend(6, 2, 32, 0.2).prepare(decodes_only).tiled is None


@needs_bf16
def test_cpu_backend_with_bf16_prompt_attention_changes_only_the_prompt_rows():
    """bf16_prefill: the step's decodes run the float32 decode kernel as before (bit for bit),
    its prompt chunks the bf16 tiled kernel: close to float32's, not equal to it."""
    meta, q, k, v, pool = mixed_step(STEPS[1], heads=6, kv_heads=2, head_dim=32, block_size=4, seed=5)
    results = {}
    for bf16 in (False, True):
        backend = CpuAttentionBackend(6, 2, 32, 0.2, bf16_prefill=bf16)
        caches = pool.clone()
        results[bf16] = backend.forward(q, k, v, caches[0], caches[1], backend.prepare(meta))
    d = meta.num_decodes
    assert d > 0 and torch.equal(results[True][:d], results[False][:d])
    torch.testing.assert_close(results[True], results[False], atol=3e-2, rtol=3e-2)
    assert not torch.equal(results[True][d:], results[False][d:])


@needs_native
def test_cpu_backend_refuses_bf16_prompt_attention_where_the_kernel_cannot_take_it(monkeypatch):
    for why, make in {
        "tiled prompt kernel": lambda: CpuAttentionBackend(6, 2, 32, 0.2, tiled_prefill=False, bf16_prefill=True),
        "head_dim 40": lambda: CpuAttentionBackend(4, 2, 40, 0.2, bf16_prefill=True),
        "float32 activations": lambda: CpuAttentionBackend(6, 2, 32, 0.2, torch.bfloat16, bf16_prefill=True),
    }.items():
        with pytest.raises(ValueError, match=why):
            make()
    backend = CpuAttentionBackend(6, 2, 32, 0.2)
    monkeypatch.setattr(backend._kernels, "has_bf16_prefill", lambda head_dim: False)  # a CPU without AVX512_BF16
    with pytest.raises(ValueError, match="AVX512_BF16"):
        backend.use_bf16_prefill(True)
    assert backend.bf16_prefill is False


def test_engine_config_refuses_bf16_prompt_attention_where_nothing_would_read_it():
    from radixserve.config import EngineConfig

    with pytest.raises(ValueError, match="prefill_attention_dtype must be one of float32, bfloat16"):
        EngineConfig(prefill_attention_dtype="float16")
    for options in ({"tiled_prefill_attention": False}, {"attention_backend": "torch"}):
        with pytest.raises(ValueError, match="tiled prompt kernel"):
            EngineConfig(prefill_attention_dtype="bfloat16", **options)
    assert EngineConfig(prefill_attention_dtype="bfloat16").prefill_attention_dtype == "bfloat16"


# ---- choosing a backend ----------------------------------------------------------------------


def test_auto_picks_cpu_where_its_kernels_build_and_torch_otherwise(monkeypatch, caplog):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert registry.resolve_backend_name("auto", cuda) == "triton"
    assert registry.resolve_backend_name("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="CPU only"):
        registry.resolve_backend_name("cpu", cuda)
    with pytest.raises(ValueError, match="unknown attention backend 'c'"):
        registry.resolve_backend_name("c", cpu)
    if native is not None:
        assert registry.resolve_backend_name("auto", cpu) == "cpu"
        assert registry.resolve_backend_name("cpu", cpu) == "cpu"
    monkeypatch.setattr(registry, "_cpu_kernels_build", lambda: False)
    with caplog.at_level(logging.WARNING, logger="radixserve.attention.registry"):
        assert registry.resolve_backend_name("auto", cpu) == "torch"
    assert "pure-torch backend" in caplog.text
    with pytest.raises(ValueError, match="could not be built"):
        registry.resolve_backend_name("cpu", cpu)


def test_cpu_backend_without_its_kernels_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("radixserve.attention.cpu_backend.load_native_attention", lambda: None)
    with pytest.raises(RuntimeError, match="attention_backend='torch'"):
        CpuAttentionBackend(4, 2, 16, 0.25)


# ---- whole generations -----------------------------------------------------------------------


@needs_native
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_cpu_backend_generates_what_the_torch_backend_does(tiny_model_dir, kind):
    model_dir = tiny_model_dir(kind)
    rng = random.Random(1)
    common = [rng.randrange(97) for _ in range(13)]
    prompts = [common + [rng.randrange(97) for _ in range(n)] for n in (2, 9, 25)] + [[5, 6, 7]]
    options = dict(block_size=4, num_kv_blocks=200, chunked_prefill_size=7, max_num_batched_tokens=16,
                   dtype="float32", device="cpu")
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    results = {}
    for name in ("torch", "cpu", "cpu+native decoder"):
        engine = Engine(str(model_dir), attention_backend=name.split("+")[0], **options)
        if name == "cpu":  # the backend's own kernels, layer by layer (tests/model/test_native_decoder.py: the other)
            engine.runner.model.native, engine.runner.row_limit = None, 0
            calls = _count_native_decodes(engine)
        first = engine.generate(prompts[:1], greedy)  # the others then hit its cached prefix
        rest = engine.generate(prompts[1:], greedy)
        results[name] = [(o.token_ids, o.cached_tokens) for o in first + rest]
        engine.check_integrity()
    assert results["cpu"] == results["torch"] == results["cpu+native decoder"]
    assert sum(cached for _, cached in results["cpu"]) >= 2 * 12, "the shared prefix should hit the cache"
    assert calls and max(calls) > 1, "the C decode kernel served batched decodes"


@needs_bf16
def test_engine_with_bf16_prompt_attention_generates_what_float32_does(tmp_path, tiny_model_dir):
    """prefill_attention_dtype bfloat16 on a tiny model with head_dim 32 (decisive logits):
    prompts, a shared cached prefix and chunked extends greedy-decode the float32 engine's
    tokens, with the same cache hits and an intact pool; at head_dim 16 the engine refuses."""
    from tiny_models import build_tiny_model

    model_dir = build_tiny_model("llama", tmp_path / "hd32", num_attention_heads=2, num_key_value_heads=1)
    rng = random.Random(2)
    common = [rng.randrange(97) for _ in range(70)]
    prompts = [common + [rng.randrange(97) for _ in range(n)] for n in (3, 40, 90)]
    options = dict(block_size=4, num_kv_blocks=400, chunked_prefill_size=64, max_num_batched_tokens=128,
                   native_decoder=False)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine(str(model_dir), prefill_attention_dtype=dtype, **options)
        assert engine.runner.backend.bf16_prefill == (dtype == "bfloat16")
        outs = engine.generate(prompts[:1], greedy) + engine.generate(prompts[1:], greedy)
        results[dtype] = [(o.token_ids, o.cached_tokens) for o in outs]
        engine.check_integrity()
    assert results["bfloat16"] == results["float32"]
    assert [cached for _, cached in results["bfloat16"]] == [0, 68, 68]  # the shared 70 tokens' 17 whole blocks
    with pytest.raises(ValueError, match="head_dim 16"):
        Engine(str(tiny_model_dir("llama")), prefill_attention_dtype="bfloat16", **options)


@needs_native
def test_engine_refuses_bf16_prompt_attention_on_a_backend_that_would_not_read_it(tiny_model_dir, monkeypatch):
    """attention_backend auto resolving to another backend than cpu (triton on a GPU machine):
    the runner refuses the option rather than ignoring it."""
    monkeypatch.setattr("radixserve.engine.engine.resolve_backend_name", lambda name, device: "torch")
    with pytest.raises(ValueError, match="read by the cpu attention backend only; this engine runs torch"):
        Engine(str(tiny_model_dir("llama")), prefill_attention_dtype="bfloat16", num_kv_blocks=64)


def _count_native_decodes(engine: Engine) -> list[int]:
    """Record the batch size of every C decode call the engine's cpu backend makes."""
    backend = engine.runner.backend
    kernels = backend._kernels
    calls: list[int] = []

    class Counting:
        def store(self, *args):
            return kernels.store(*args)

        def decode(self, q, *args):
            calls.append(q.shape[0])
            return kernels.decode(q, *args)

        has_prefill = kernels.has_prefill

        def prefill(self, *args):
            return kernels.prefill(*args)

    backend._kernels = Counting()
    return calls
