"""The C decode-attention kernel (and the torch backend's pure-torch decode path) against a
dense float64 reference, on paged pools where neighbouring requests share prefix blocks."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.attention.metadata import AttentionMetadata
from radixserve.ops.native_attention import load_native_attention
from radixserve.attention.torch_backend import TorchAttentionBackend

native = load_native_attention()
needs_native = pytest.mark.skipif(native is None, reason="no C compiler here")


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


def dense_reference(q, k_cache, v_cache, block_tables, seq_lens, scale):
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for r, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[r, : -(-n // k_cache.shape[1])].long()
        k = k_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(group, 1)
        v = v_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(group, 1)
        weights = (torch.einsum("hd,thd->ht", q[r].double(), k) * scale).softmax(-1)
        out[r] = torch.einsum("ht,thd->hd", weights, v).float()
    return out


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


@pytest.mark.parametrize("use_native", [False, True])
def test_torch_backend_decode_paths_match_reference(use_native):
    if use_native and native is None:
        pytest.skip("no C compiler here")
    lens = [37, 64, 65, 1, 200, 33]
    q, k_cache, v_cache, tables, seq_lens = build_case(
        lens, [2, 2, 2, 0, 2, 2], heads=9, kv_heads=3, head_dim=64, block_size=16
    )
    backend = TorchAttentionBackend(9, 3, 64, 0.125)
    backend.use_native = use_native
    meta = AttentionMetadata(
        num_decodes=len(lens), block_size=16,
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32), seq_lens=seq_lens,
        block_tables=tables, slot_mapping=torch.zeros(len(lens), dtype=torch.int64),
        max_query_len=1, max_seq_len=max(lens),
        query_start_loc_list=list(range(len(lens) + 1)), seq_lens_list=lens,
    )
    backend.prepare(meta)
    backend._meta = meta
    got = backend._decode(q, k_cache, v_cache)
    torch.testing.assert_close(got, dense_reference(q, k_cache, v_cache, tables, seq_lens, 0.125),
                               atol=2e-5, rtol=2e-5)


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
    TorchAttentionBackend._store(k, v, want_k, want_v, slots)  # the pure-torch path
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
