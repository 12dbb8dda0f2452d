"""fp8 KV pages (kv_cache_dtype fp8_e4m3, kernels/quantized_pages.py): the layout and its
rounding against an independent float64 reference, the Triton store's bit-level encoder
(the interpreter's own fp8 cast rounds differently, so the store does not use it), the Triton
store, decode and extend kernels and the torch and triton backends against float64 attention
over the dequantized pages (odd lengths, partial blocks, shared prefixes, GQA), the start-up
refusals, and engines on fp8 pages through the torch backend.

The Triton kernels run in the interpreter here (RADIXSERVE_TEST_DEVICE=cuda compiles them
for a GPU, as tests/kernels/test_kernels.py)."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.attention.cpu_backend import CpuAttentionBackend
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.config import EngineConfig
from radixserve.kernels import quantized_pages
from radixserve.kernels.quantized_pages import FP8_E4M3, INT8, QuantizedPages, check_kv_cache_dtype, dequantize, quantize
from radixserve.kernels.triton import configure_triton  # imports no triton
from radixserve.server.metrics import ServerMetrics
from test_kv_quant import TEST_DEVICE, _triton_backend, empty_pages, expected_mixed, mixed_step

configure_triton(TEST_DEVICE)  # before triton's first import
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
on_cpu_triton = pytest.mark.skipif(not HAS_TRITON or TEST_DEVICE != "cpu",
                                   reason="triton is not installed, or its kernels are compiled for another device here")

if HAS_TRITON:
    import triton
    import triton.language as tl

    from radixserve.kernels.triton.decode_attention import decode_attention
    from radixserve.kernels.triton.extend_attention import extend_attention
    from radixserve.kernels.triton.store_kv import _e4m3_bits
    from test_kernels import (DEVICE, HEADS, _decode_case, _decode_contexts, _extend_case, _float64_rows,
                              _quantized_views, _store_quantized)

    @triton.jit
    def _encode_kernel(y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, _e4m3_bits(tl.load(y_ptr + i, mask=i < n, other=0.0)), mask=i < n)


def e4m3_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value in code order 0..126 (positive half), float64."""
    return torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()


def nearest_e4m3_codes(y: torch.Tensor) -> torch.Tensor:
    """Independent reference: the code (0..126, sign apart) nearest |y|, ties to the even code."""
    values = e4m3_values()
    a = y.double().abs()[:, None]
    distance = (values[None, :] - a).abs()
    best = distance.min(1, keepdim=True).values
    candidates = distance == best  # one, or two at a tie
    codes = torch.arange(127)[None, :].expand_as(candidates)
    even = candidates & (codes % 2 == 0)
    pick = torch.where(even.any(1, keepdim=True), even, candidates)
    return (pick * codes).amax(1)


def tie_points() -> torch.Tensor:
    """Every midpoint between neighbouring e4m3 values, a float32 ulp either side of it,
    every value itself, zero and 448, both signs (float32)."""
    values = e4m3_values().float()
    mids = (values[1:] + values[:-1]) / 2
    points = torch.cat([values, mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(500.0))])
    return torch.cat([points, -points])


# ---- the layout and its arithmetic --------------------------------------------------------------


def test_fp8_pages_share_int8s_layout_and_bytes():
    fp8, int8 = QuantizedPages(16, 3, 64, FP8_E4M3), QuantizedPages(16, 3, 64, INT8)
    assert fp8.page_bytes == int8.page_bytes == 16 * 3 * 64 + 16 * 3 * 4
    raw = torch.zeros(2, fp8.page_bytes, dtype=torch.uint8)
    assert fp8.codes(raw).dtype == torch.float8_e4m3fn and fp8.codes(raw).shape == (2, 16, 3, 64)
    assert fp8.scales(raw).shape == (2, 16, 3)
    geometry = (30, 16, 3, 64, torch.float32)
    assert KVPool.bytes_per_block(*geometry, kv_cache_dtype="fp8_e4m3") == KVPool.bytes_per_block(*geometry, "int8")
    pool = KVPool(2, 4, 16, 3, 64, torch.float32, torch.device("cpu"), kv_cache_dtype="fp8_e4m3")
    assert pool.pages.code is FP8_E4M3 and pool.kv.dtype == torch.uint8
    assert pool.bytes_per_token == 2 * 2 * 3 * (64 + 4)


def test_fp8_rounding_is_nearest_even_with_subnormals():
    y = torch.cat([tie_points(), torch.linspace(-448, 448, 20001), torch.linspace(-0.05, 0.05, 20001)])
    codes = FP8_E4M3.round(y).view(torch.uint8)
    assert torch.equal((codes & 0x7F).long(), nearest_e4m3_codes(y))
    assert not (codes & 0x7F == 0x7F).any()  # never NaN
    assert torch.equal(FP8_E4M3.round(torch.tensor([1e30, -1e30])).float(), torch.tensor([448.0, -448.0]))


def test_fp8_quantize_keeps_each_token_heads_scale():
    x = torch.randn(9, 3, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-4, 1.0, 300.0])[:, None]
    x[2, 1] = 0.0  # an all-zero head: scale 0, codes 0
    codes, scales = quantize(x, FP8_E4M3)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (9, 3)
    assert codes.float().abs().amax(-1)[[0, 1, 3]].eq(448).all()
    assert scales[2, 1] == 0 and codes[2, 1].float().abs().sum() == 0
    y = x / torch.where(scales > 0, scales, 1)[..., None]
    # half an e4m3 step: 2^-4 of |y| for normals, 2^-10 below 2^-6 (subnormals)
    bound = torch.maximum(y.abs() * 2**-4, torch.full_like(y, 2**-10)) * scales[..., None] * (1 + 1e-5)
    assert ((dequantize(codes, scales) - x).abs() <= bound).all()


def test_fp8_store_and_read_round_trip_through_pages():
    pages = QuantizedPages(5, 2, 40, FP8_E4M3)
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 13, 2, 40, generator=gen)
    k_pages, v_pages = empty_pages(pages, 4)
    slots = torch.randperm(20, generator=gen)[:13]
    k_held, v_held = pages.store(k, v, k_pages, v_pages, slots)
    blocks, offsets = slots // 5, slots % 5
    torch.testing.assert_close(pages.read(k_pages, torch.float32)[blocks, offsets], k_held, atol=0, rtol=0)
    torch.testing.assert_close(pages.read(v_pages, torch.float32)[blocks, offsets], v_held, atol=0, rtol=0)
    torch.testing.assert_close(k_held, k, atol=0.2, rtol=0.07)


# ---- the start-up rules -----------------------------------------------------------------------


def test_fp8_on_cpu_needs_the_torch_backend():
    for backend in ("auto", "cpu"):
        with pytest.raises(ValueError, match="--attention-backend torch"):
            check_kv_cache_dtype("fp8_e4m3", torch.device("cpu"), backend)
    check_kv_cache_dtype("fp8_e4m3", torch.device("cpu"), "torch")
    with pytest.raises(ValueError, match="not read by the cpu attention backend"):
        EngineConfig(kv_cache_dtype="fp8_e4m3", attention_backend="cpu")
    with pytest.raises(ValueError, match="reads int8 KV pages, not fp8_e4m3"):
        CpuAttentionBackend(2, 1, 16, 0.25, torch.float32, QuantizedPages(4, 1, 16, FP8_E4M3))


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_fp8_with_triton_on_cuda_needs_compute_capability_8_9(monkeypatch, capability, refused):
    monkeypatch.setattr(quantized_pages.torch.cuda, "get_device_capability", lambda device: capability)
    for backend in ("auto", "triton"):
        if refused:
            with pytest.raises(ValueError, match="compute capability 8.9"):
                check_kv_cache_dtype("fp8_e4m3", torch.device("cuda"), backend)
        else:
            check_kv_cache_dtype("fp8_e4m3", torch.device("cuda"), backend)
    check_kv_cache_dtype("fp8_e4m3", torch.device("cuda"), "torch")  # torch converts on any GPU


# ---- the Triton kernels -----------------------------------------------------------------------


@needs_triton
def test_triton_e4m3_encoder_writes_torchs_bytes():
    """Every tie and its float32 neighbours, every value, subnormals, signed zeros."""
    y = torch.cat([tie_points(), torch.linspace(-448, 448, 40001), torch.linspace(-0.03, 0.03, 40001),
                   torch.tensor([-0.0, 0.0, 2**-10, 3 * 2**-10, 2**-6 - 2**-12])]).to(DEVICE)
    out = torch.empty(y.numel(), dtype=torch.uint8, device=DEVICE)
    _encode_kernel[(triton.cdiv(y.numel(), 1024),)](y, out, y.numel(), BLOCK=1024)
    assert torch.equal(out.cpu(), y.cpu().to(torch.float8_e4m3fn).view(torch.uint8))


@needs_triton
@pytest.mark.parametrize("block_size, kv_heads", [(1, 2), (5, 1), (16, 3)])
def test_store_kv_fp8_writes_the_reference_bytes(block_size, kv_heads):
    g_views, w_views = _store_quantized(QuantizedPages(block_size, kv_heads, 64, FP8_E4M3), 9, tiny_token=True)
    assert g_views[0].dtype == torch.float8_e4m3fn
    for a, b in zip(g_views, w_views):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # codes and scales, byte for byte
    assert int(w_views[2].count_nonzero()) == 6 * kv_heads  # every stored token's heads, nothing else


@needs_triton
@pytest.mark.parametrize("heads", HEADS if HAS_TRITON else [])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_fp8_matches_float64(heads, block_size, num_splits):
    paged, q = _decode_case(heads, 64, block_size, torch.float32, _decode_contexts(block_size), 2)
    (k_codes, v_codes, k_scales, v_scales), dequantized = _quantized_views(paged, "fp8_e4m3")
    assert k_codes.dtype == torch.float8_e4m3fn
    out = decode_attention(q, k_codes, v_codes, paged.block_tables, paged.seq_lens, 0.125, num_splits=num_splits,
                           k_scales=k_scales, v_scales=v_scales)
    starts = list(range(q.shape[0] + 1))
    expected = _float64_rows(q, dequantized, paged.block_tables, paged.seq_lens, starts, 0.125)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)


@needs_triton
@pytest.mark.parametrize("heads", HEADS if HAS_TRITON else [])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_extend_fp8_matches_float64(heads, block_size):
    case = _extend_case(heads, 64, block_size, torch.float32, shared_blocks=2 if block_size > 1 else 20)
    p = case.paged
    (k_codes, v_codes, k_scales, v_scales), dequantized = _quantized_views(p, "fp8_e4m3")
    out = extend_attention(case.q, k_codes, v_codes, p.block_tables, case.query_start_loc, p.seq_lens, 0.125,
                           k_scales=k_scales, v_scales=v_scales)
    expected = _float64_rows(case.q, dequantized, p.block_tables, p.seq_lens, case.query_start_loc.tolist(), 0.125)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-5, rtol=2e-5)


# ---- the backends: a mixed step over fp8 pages ------------------------------------------------


@pytest.mark.parametrize("backend_class", [lambda: TorchAttentionBackend,
                                           pytest.param(_triton_backend, marks=on_cpu_triton)], ids=["torch", "triton"])
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", [(16, 9, 3, 64), (5, 4, 2, 32)])
def test_backends_on_fp8_pages_match_float64(backend_class, block_size, heads, kv_heads, head_dim):
    pages = QuantizedPages(block_size, kv_heads, head_dim, FP8_E4M3)
    q, k, v, k_pages, v_pages, meta, tables, contexts, new = mixed_step(pages, heads)
    scale = head_dim**-0.5
    backend = backend_class()(heads, kv_heads, head_dim, scale, torch.float32, pages)
    out = backend.forward(q, k, v, k_pages, v_pages, backend.prepare(meta))
    expected = expected_mixed(pages, q, k_pages, v_pages, tables, contexts, new, scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    codes, _ = quantize(k[-1], FP8_E4M3)  # the step's last token was quantized into its slot
    slot = int(meta.slot_mapping[-1])
    held = pages.codes(k_pages)[slot // block_size, slot % block_size]
    assert torch.equal(held.view(torch.uint8), codes.view(torch.uint8))


# ---- engines on fp8 pages (torch backend, a tiny random model) ----------------------------------

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def fp8_engine(directory, **options):
    defaults = dict(block_size=4, num_kv_blocks=256, chunked_prefill_size=7, max_num_batched_tokens=16,
                    kv_cache_dtype="fp8_e4m3", attention_backend="torch")
    return Engine(str(directory), **{**defaults, **options})


def prompts_of(lengths, seed=0, vocab=97):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=gen).tolist() for n in lengths]


def tokens(outs):
    return [o.token_ids for o in outs]


def test_engine_refuses_fp8_on_cpu_without_the_torch_backend(tiny_model_dir):
    with pytest.raises(ValueError, match="--attention-backend torch"):
        Engine(str(tiny_model_dir("llama")), kv_cache_dtype="fp8_e4m3")


def test_fp8_engine_sizes_like_int8_and_reports_it(tiny_model_dir):
    directory = tiny_model_dir("llama")
    fp8 = fp8_engine(directory, block_size=16, num_kv_blocks=None, kv_cache_memory=4 << 20)
    int8 = Engine(str(directory), block_size=16, kv_cache_memory=4 << 20, kv_cache_dtype="int8")
    assert fp8.pool.num_blocks == int8.pool.num_blocks
    s = fp8.stats()
    assert s["kv_cache_dtype"] == "fp8_e4m3" and s["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 4)
    assert 'radixserve_kv_cache_dtype{dtype="fp8_e4m3"} 1.0' in ServerMetrics(fp8.snapshot, dict).render().decode()


def test_fp8_greedy_shares_prefixes_and_preempts_with_the_same_tokens(tiny_model_dir):
    directory = tiny_model_dir("llama")
    shared = prompts_of([24], seed=3)[0]
    prompts = [shared + p for p in prompts_of([5, 9, 2, 13], seed=4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = [tokens(fp8_engine(directory).generate([p], params))[0] for p in prompts]
    engine = fp8_engine(directory)
    assert tokens(engine.generate(prompts, params)) == alone
    assert engine.stats()["cached_prompt_tokens"] >= 24
    engine.check_integrity()
    tight = fp8_engine(directory, num_kv_blocks=14)  # too few for all at once
    assert tokens(tight.generate(prompts, params)) == alone
    assert tight.stats()["preemptions"] > 0
    tight.check_integrity()


def test_a_restart_from_int8_pages_onto_fp8_starts_cold(tiny_model_dir, tmp_path, caplog):
    """Same page bytes, other codes: the fingerprint tells them apart."""
    directory = tiny_model_dir("llama")
    prompt = prompts_of([40], seed=6)[0]
    options = dict(num_kv_blocks=16, kv_persist_dir=str(tmp_path), kv_offload_memory=1 << 20)
    first = fp8_engine(directory, kv_cache_dtype="int8", attention_backend="auto", **options)
    first.generate([prompt], GREEDY)
    first.generate(prompts_of([30, 30], seed=7), GREEDY)  # evicts the prompt's blocks to the tier
    assert first.flush_tier()
    first.close()
    caplog.set_level(logging.WARNING)
    other = fp8_engine(directory, **options)
    assert other.tiering.loaded_blocks == 0
    assert "kv_cache_dtype" in caplog.text and "ignored" in caplog.text
    assert other.generate([prompt], GREEDY)[0].cached_tokens == 0
    other.check_integrity()
    other.close()
