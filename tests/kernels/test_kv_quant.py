"""int8 KV pages (kernels/quantized_pages.py): the layout and its arithmetic, the pool's sizing,
and every CPU path that writes or reads them (the torch reference, the C store and decode
kernels, the torch and cpu backends) against a float64 reference on the dequantized pages,
with odd lengths, partial blocks, shared prefixes and GQA."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

from radixserve.attention.cpu_backend import CpuAttentionBackend
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.kernels.quantized_pages import QuantizedPages, check_kv_cache_dtype, dequantize, quantize
from radixserve.kernels.native_attention import load_native_attention
from radixserve.kernels.triton import configure_triton  # imports no triton
from attention_reference import dense_reference

TEST_DEVICE = os.environ.get("RADIXSERVE_TEST_DEVICE", "cpu")
configure_triton(TEST_DEVICE)  # at collection, before anything imports triton (as tests/kernels/test_kernels.py)

native = load_native_attention()
needs_native = pytest.mark.skipif(native is None, reason="no C compiler here")


def _triton_backend():
    from radixserve.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None or TEST_DEVICE != "cpu",
                                  reason="triton is not installed, or its kernels are compiled for another device here")
BACKENDS = [lambda: TorchAttentionBackend, pytest.param(lambda: CpuAttentionBackend, marks=needs_native),
            pytest.param(_triton_backend, marks=needs_triton)]
TOL = dict(atol=3e-5, rtol=3e-5)


def empty_pages(pages: QuantizedPages, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(num_blocks, pages.page_bytes, dtype=torch.uint8),
            torch.zeros(num_blocks, pages.page_bytes, dtype=torch.uint8))


def quantized_case(lens, shared_blocks, *, heads, kv_heads, head_dim, block_size, seed=0):
    """Requests of context `lens` over int8 pages; request i's table starts with the first
    shared_blocks[i] blocks of one common prefix. Returns q, the pages, tables, lengths, the
    layout and the pages dequantized ([blocks, block_size, kv_heads, head_dim] float32)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    needed = sum(-(-n // block_size) for n in lens) + max(shared_blocks) + 3
    free = list(range(needed))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(max(shared_blocks))]
    tables = [prefix[:s] + [free.pop() for _ in range(-(-n // block_size) - s)] for n, s in zip(lens, shared_blocks)]
    width = max(len(t) for t in tables)
    pages = QuantizedPages(block_size, kv_heads, head_dim)
    k_pages, v_pages = empty_pages(pages, needed)
    k = torch.randn(needed * block_size, kv_heads, head_dim, generator=gen) * 2
    v = torch.randn(needed * block_size, kv_heads, head_dim, generator=gen)
    pages.store(k, v, k_pages, v_pages, torch.arange(needed * block_size))
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return (q, k_pages, v_pages, block_tables, torch.tensor(lens, dtype=torch.int32), pages,
            pages.read(k_pages, torch.float32), pages.read(v_pages, torch.float32))




# ---- the layout and its arithmetic ---------------------------------------------------------


def test_page_layout_holds_codes_then_scales():
    pages = QuantizedPages(block_size=16, num_kv_heads=3, head_dim=64)
    assert (pages.code_bytes, pages.page_bytes) == (3072, 3072 + 16 * 3 * 4)
    odd = QuantizedPages(block_size=5, num_kv_heads=1, head_dim=7)  # codes rounded up to whole floats
    assert (odd.code_bytes, odd.page_bytes) == (36, 56)
    raw = torch.zeros(2, pages.page_bytes, dtype=torch.uint8)
    pages.scales(raw)[1, 15, 2] = 1.5
    pages.codes(raw)[1, 0, 0, 0] = -3
    assert raw[1, 0].view(torch.int8).item() == -3
    assert raw[1, pages.page_bytes - 4 :].view(torch.float32).item() == 1.5
    assert raw[0].sum() == 0


def test_quantize_is_symmetric_per_token_head_and_round_trips():
    x = torch.randn(7, 3, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([0.01, 1.0, 50.0])[:, None]
    x[2, 1] = 0.0  # an all-zero head: scale 0, codes 0
    codes, scales = quantize(x)
    assert codes.dtype == torch.int8 and scales.shape == (7, 3)
    assert codes.abs().amax(-1).tolist()[0] == [127, 127, 127]
    assert scales[2, 1] == 0 and codes[2, 1].abs().sum() == 0
    error = (dequantize(codes, scales) - x).abs()
    assert (error <= scales[..., None] / 2 * (1 + 1e-5)).all()


def test_int8_pool_buys_at_least_3_5_times_the_blocks():
    geometry = (30, 16, 3, 64, torch.float32)  # the default model, 16-token blocks
    f32, i8 = KVPool.bytes_per_block(*geometry), KVPool.bytes_per_block(*geometry, kv_cache_dtype="int8")
    assert f32 / i8 >= 3.5
    pool = KVPool(2, 4, 16, 3, 64, torch.float32, torch.device("cpu"), kv_cache_dtype="int8")
    assert pool.kv.dtype == torch.uint8 and pool.block_shape() == (2, 2, pool.pages.page_bytes)
    assert pool.block_bytes == KVPool.bytes_per_block(2, 16, 3, 64, torch.float32, "int8")
    assert pool.bytes_per_token == pool.block_bytes / 16


def test_unknown_dtypes_are_refused_everywhere():  # fp8's rules: test_kv_fp8.py
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        check_kv_cache_dtype("int4", torch.device("cpu"))
    check_kv_cache_dtype("int8", torch.device("cpu"))


# ---- the C kernels ---------------------------------------------------------------------------


@needs_native
@pytest.mark.parametrize("block_size, kv_heads, head_dim", [(16, 3, 64), (5, 2, 40), (1, 1, 16)])
def test_native_store_writes_the_reference_bytes(block_size, kv_heads, head_dim):
    pages = QuantizedPages(block_size, kv_heads, head_dim)
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(16 * block_size, generator=gen)[:11].contiguous()
    k = torch.randn(11, kv_heads, head_dim, generator=gen) * 3
    v = torch.randn(11, kv_heads, head_dim, generator=gen)
    expected, got = empty_pages(pages, 16), empty_pages(pages, 16)
    pages.store(k, v, *expected, slots)
    assert native.store(k, v, *got, slots, pages)
    for e, g in zip(expected, got):
        code_diff = (pages.codes(e).int() - pages.codes(g).int()).abs()
        assert code_diff.max() <= 1 and (code_diff > 0).float().mean() < 1e-3  # only ties may round apart
        torch.testing.assert_close(pages.scales(g), pages.scales(e), atol=0, rtol=1e-6)
    with pytest.raises(ValueError, match="outside the pool"):
        native.store(k, v, *got, torch.full((11,), 16 * block_size), pages)


CASES = [
    ([37, 64, 65, 1, 200, 33, 130, 131, 3], [2, 2, 2, 0, 2, 2, 2, 2, 0]),
    ([17] * 20, [1] * 20),  # more sharers than one group holds
    ([5, 300, 2], [0, 0, 0]),
]


@needs_native
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 2), (2, 2)])
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (40, 5)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_native_decode_on_int8_pages_matches_float64(heads, kv_heads, head_dim, block_size, case):
    lens, shared = CASES[case]
    shared = [min(s, n // block_size) for s, n in zip(shared, lens)]
    q, kp, vp, tables, seq_lens, pages, k_deq, v_deq = quantized_case(
        lens, shared, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    scale = head_dim**-0.5
    got = native.decode(q, kp, vp, tables, seq_lens, scale, pages)
    torch.testing.assert_close(got, dense_reference(q, k_deq, v_deq, tables, seq_lens, scale), **TOL)


# Shapes for each vector width's build: GQA groups of 3, 8 (more heads than the AVX-512 path
# folds at once: it goes through its tile) and 1; head dims 64 (compiled apart), 40, 128 (two
# 64-dim slices) and 18 (a partial dword); blocks of 16, 5, 3 and 32 (two 16-token slices).
WIDTH_SHAPES = [(9, 3, 64, 16), (8, 1, 40, 5), (4, 4, 128, 32), (2, 1, 18, 3)]


@needs_native
@pytest.mark.parametrize("flags", [[], ["-mno-avx512f"], ["-mno-avx512f", "-mno-avx2", "-mno-fma"]],
                         ids=["native", "avx2", "scalar"])
def test_native_decode_on_int8_pages_builds_for_each_vector_width(tmp_path, flags):
    """The int8 (and float32) decode of this machine's build, and of builds with AVX-512 (then AVX2) switched
    off, which take the generic path, against float64 on the dequantized pages: one row alone,
    rows sharing a prefix, partial blocks."""
    import ctypes
    import shutil

    from radixserve.kernels import native_build
    from radixserve.kernels.native_attention import NativePagedAttention

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here")
    library = tmp_path / "paged_attention.so"
    native_build._compile(compiler, native_build.CSRC / "paged_attention.c", ["-fopenmp", *flags], library)
    built = ctypes.CDLL(str(library))
    fns = []
    for name in ("paged_decode_attention_f32", "paged_store_f32", "paged_decode_attention_i8", "paged_store_i8"):
        fn = getattr(built, name)
        fn.argtypes = list(native_build.SIGNATURES[name].argtypes)
        fn.restype = native_build.SIGNATURES[name].restype
        fns.append(fn)
    kernels = NativePagedAttention(*fns)
    for heads, kv_heads, head_dim, block_size in WIDTH_SHAPES:
        for lens, shared in [([1, 37, 70], [0, 0, 0]), ([40, 70, 33, 9], [2, 2, 1, 0])]:
            shared = [min(s, n // block_size) for s, n in zip(shared, lens)]
            q, kp, vp, tables, seq_lens, pages, k_deq, v_deq = quantized_case(
                lens, shared, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
            scale = head_dim**-0.5
            got = kernels.decode(q, kp, vp, tables, seq_lens, scale, pages)
            torch.testing.assert_close(got, dense_reference(q, k_deq, v_deq, tables, seq_lens, scale), **TOL)
            # The same values as float32 pages: the float decode of each build (every width
            # takes the generic attend_block for float pages).
            k_cache = k_deq.reshape(-1, block_size, kv_heads, head_dim).contiguous()
            v_cache = v_deq.reshape(-1, block_size, kv_heads, head_dim).contiguous()
            got = kernels.decode(q, k_cache, v_cache, tables, seq_lens, scale)
            torch.testing.assert_close(got, dense_reference(q, k_cache, v_cache, tables, seq_lens, scale), **TOL)


@needs_native
def test_native_decode_refuses_pages_of_another_layout():
    q, kp, vp, tables, seq_lens, pages, *_ = quantized_case([20], [0], heads=2, kv_heads=1, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="int8 pages must be"):
        native.decode(q, kp[:, :-4], vp[:, :-4], tables, seq_lens, 0.25, pages)
    with pytest.raises(ValueError, match="past its block table"):
        native.decode(q, kp, vp, tables, seq_lens + 100, 0.25, pages)


# ---- the backends: a mixed step (decodes, a fresh prompt, a prompt over a cached prefix) --------


def mixed_step(pages: QuantizedPages, heads: int, seed: int = 0):
    """Pages holding 3 requests' cached contexts, and one step over them: two decodes
    (contexts 37 and 6 after the step), a fresh 11-token prompt and a 9-token chunk after 23
    cached tokens. Returns the backend inputs and the float64 expectation per request."""
    gen = torch.Generator().manual_seed(seed)
    bs, kvh, hd = pages.block_size, pages.num_kv_heads, pages.head_dim
    k_pages, v_pages = empty_pages(pages, 64)
    contexts, new = [37, 6, 11, 32], [1, 1, 11, 9]
    free = torch.randperm(64, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in contexts]
    slots = lambda t, a, b: [t[p // bs] * bs + p % bs for p in range(a, b)]  # noqa: E731
    for t, n, m in zip(tables, contexts, new):  # the cached part
        if n - m:
            kc, vc = torch.randn(2, n - m, kvh, hd, generator=gen)
            pages.store(kc, vc, k_pages, v_pages, torch.tensor(slots(t, 0, n - m)))
    k, v = torch.randn(2, sum(new), kvh, hd, generator=gen)
    q = torch.randn(sum(new), heads, hd, generator=gen)
    slot_mapping = torch.tensor([s for t, n, m in zip(tables, contexts, new) for s in slots(t, n - m, n)])
    width = max(len(t) for t in tables)
    starts = [0, 1, 2, 13, 22]
    meta = AttentionMetadata(
        num_decodes=2, block_size=bs, query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(contexts, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=slot_mapping, query_start_loc_list=starts, seq_lens_list=contexts,
    )
    return q, k, v, k_pages, v_pages, meta, tables, contexts, new


def expected_mixed(pages, q, k_pages, v_pages, tables, contexts, new, scale):
    """float64 causal attention of every query row over the pages after the store."""
    keys, values = pages.read(k_pages, torch.float32), pages.read(v_pages, torch.float32)
    group = q.shape[1] // pages.num_kv_heads
    out, row = torch.empty_like(q), 0
    for t, n, m in zip(tables, contexts, new):
        kc = keys[t].flatten(0, 1)[:n].double().repeat_interleave(group, 1)
        vc = values[t].flatten(0, 1)[:n].double().repeat_interleave(group, 1)
        for i in range(m):
            visible = n - m + i + 1
            w = (torch.einsum("hd,thd->ht", q[row].double(), kc[:visible]) * scale).softmax(-1)
            out[row] = torch.einsum("ht,thd->hd", w, vc[:visible]).float()
            row += 1
    return out


@pytest.mark.parametrize("backend_class", BACKENDS, ids=["torch", "cpu", "triton"])
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", [(16, 9, 3, 64), (5, 4, 2, 32)])
def test_backends_on_int8_pages_match_float64(backend_class, block_size, heads, kv_heads, head_dim):
    """Triton's kernels run in its interpreter here."""
    backend_class = backend_class()
    pages = QuantizedPages(block_size, kv_heads, head_dim)
    q, k, v, k_pages, v_pages, meta, tables, contexts, new = mixed_step(pages, heads)
    scale = head_dim**-0.5
    backend = backend_class(heads, kv_heads, head_dim, scale, torch.float32, pages)
    out = backend.forward(q, k, v, k_pages, v_pages, backend.prepare(meta))
    expected = expected_mixed(pages, q, k_pages, v_pages, tables, contexts, new, scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    codes, _ = quantize(k[-1])  # the step's last token was quantized into its slot
    slot = int(meta.slot_mapping[-1])
    assert torch.equal(pages.codes(k_pages)[slot // block_size, slot % block_size], codes)


@needs_native
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", [(16, 9, 3, 64), (5, 4, 2, 40), (3, 2, 1, 20)])
@pytest.mark.parametrize("tiled", [True, False])
def test_cpu_backend_prompt_chunks_on_int8_pages_match_float64(block_size, heads, kv_heads, head_dim, tiled):
    """The tiled prefill kernel's int8 instantiation (and SDPA, tiled off) on a step of
    prompt chunks only: a fresh prompt and an extend that starts inside a block."""
    pages = QuantizedPages(block_size, kv_heads, head_dim)
    q, k, v, k_pages, v_pages, meta, tables, contexts, new = mixed_step(pages, heads, seed=2)
    skip = 2  # drop the decodes: rows 0 and 1
    meta = AttentionMetadata(
        num_decodes=0, block_size=block_size, query_start_loc=meta.query_start_loc[skip:] - skip,
        seq_lens=meta.seq_lens[skip:], block_tables=meta.block_tables[skip:], slot_mapping=meta.slot_mapping[skip:],
        query_start_loc_list=[s - skip for s in meta.query_start_loc_list[skip:]],
        seq_lens_list=meta.seq_lens_list[skip:],
    )
    scale = head_dim**-0.5
    backend = CpuAttentionBackend(heads, kv_heads, head_dim, scale, torch.float32, pages, tiled_prefill=tiled)
    plan = backend.prepare(meta)
    assert (plan.tiled is not None) == (tiled and native.has_prefill)
    out = backend.forward(q[skip:].contiguous(), k[skip:].contiguous(), v[skip:].contiguous(), k_pages, v_pages, plan)
    expected = expected_mixed(pages, q[skip:], k_pages, v_pages, tables[skip:], contexts[skip:], new[skip:], scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(native is None or not native.has_bf16_prefill(64), reason="no AVX512_BF16 on this CPU")
@pytest.mark.parametrize("block_size", [16, 5])
def test_bf16_prompt_attention_on_int8_pages_is_that_of_their_dequantized_floats(block_size):
    """The tiled kernel's bf16 path over int8 pages dequantizes each row to float32 as it packs a
    tile, then rounds to bf16 as the float32 pool's path does: bit for bit the float32 pool
    path's result on the pages' dequantized values, extends and a shared prefix included."""
    from test_native_attention import build_chunks

    heads, kv_heads, head_dim = 9, 3, 64
    q, k_cache, v_cache, tables, starts, lens = build_chunks([(301, 300, 0), (700, 237, 0), (96, 40, 0)], heads=heads,
                                                             kv_heads=kv_heads, head_dim=head_dim,
                                                             block_size=block_size, seed=block_size)
    pages = QuantizedPages(block_size, kv_heads, head_dim)
    k_pages, v_pages = (torch.zeros(k_cache.shape[0], pages.page_bytes, dtype=torch.uint8) for _ in range(2))
    pages.store(k_cache.flatten(0, 1), v_cache.flatten(0, 1), k_pages, v_pages,
                torch.arange(k_cache.shape[0] * block_size))
    k_float, v_float = (dequantize(pages.codes(p), pages.scales(p)) for p in (k_pages, v_pages))
    scale = head_dim**-0.5
    out_pages, out_floats = torch.full_like(q, 7.0), torch.full_like(q, 7.0)
    native.prefill(q, k_pages, v_pages, tables, starts, lens, scale, out_pages, pages, True)
    native.prefill(q, k_float.contiguous(), v_float.contiguous(), tables, starts, lens, scale, out_floats, None, True)
    assert torch.equal(out_pages, out_floats)
    exact = torch.full_like(q, 7.0)
    native.prefill(q, k_pages, v_pages, tables, starts, lens, scale, exact, pages)
    torch.testing.assert_close(out_pages, exact, atol=3e-2, rtol=3e-2)
