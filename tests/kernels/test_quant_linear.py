"""The quantized-weight kernels (csrc/quant_linear.c) on every path against a float64
reference of the dequantized weight and the kernel's own activation rounding, with float16 and
float32 scales; the layouts' packing (one feature a row, and lanes), fusing and load-time
quantization. Path "best" takes the lanes layout where the CPU has AVX512-VNNI, as the model
stores its weights there."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.quant_linear import (
    LANES, PATHS, QuantWeight, best_path, concat_rows, lanes_preferred, pack_nibbles, quant_linear, quantize,
    unpack_codes,
)

needs_kernel = pytest.mark.skipif(best_path() is None, reason="no C compiler here")
FORMATS = [(8, None), (8, 32), (8, 16), (4, 32), (4, 16), (4, 64), (4, 128), (8, 256)]


def _rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: per 32-element block dx = max|x| / 127, a high int8 code and
    a residual one in 1/256ths of dx."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32).double()
    dx = (blocks.abs().amax(-1, keepdim=True).float() / 127).double()
    v = torch.where(dx > 0, blocks / dx, torch.zeros_like(blocks))
    hi = torch.round(v).clamp(-127, 127)
    lo = torch.round((v - hi) * 256).clamp(-127, 127)
    return ((hi + lo / 256) * dx).reshape(m, k)


def _weight(bits, group, n=67, k=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=gen), bits, group)


def _for_path(weight: QuantWeight, path: str) -> QuantWeight:
    """The weight as the model stores it for `path`: lanes for the best path on AVX512-VNNI."""
    return weight.to_lanes() if path == "best" and lanes_preferred() else weight


def _widened(weight: QuantWeight) -> QuantWeight:
    """The same values with float32 scales and offsets."""
    offset = None if weight.offset is None else weight.offset.float()
    return QuantWeight(weight.codes, weight.scale.float(), offset, weight.bits, weight.group, weight.zero, weight.kind)


@needs_kernel
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("bits, group", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13])
@pytest.mark.parametrize("scales", ["float16", "float32"])
def test_every_path_is_the_float64_product_of_the_rounded_activations(path, bits, group, rows, scales):
    weight = _weight(bits, group, seed=rows)
    assert weight.scale.dtype == torch.float16
    weight = weight if scales == "float16" else _widened(weight)
    gen = torch.Generator().manual_seed(100 + rows)
    wide = torch.randn(rows, 2 * 256, generator=gen) * torch.rand(rows, 2 * 256, generator=gen) * 4
    x = wide[:, :256]  # rows 512 floats apart: the kernel follows the stride
    bias = torch.randn(67, generator=gen)
    got = quant_linear(x, _for_path(weight, path), bias, path)
    want = _rounded_activations(x) @ weight.dequantize().double().T + bias.double()
    assert got.shape == (rows, 67)
    assert (got.double() - want).abs().max() <= 3e-5 * want.abs().max()
    exact = x.double() @ weight.dequantize().double().T + bias.double()
    assert (got.double() - exact).abs().max() <= 2e-3 * exact.abs().max()  # ~16-bit activations


# The GGUF types as repacked (model/gguf_repack.py): (bits, group, zero, offsets): Q8_0, Q5_0,
# Q6_K, Q4_0 are symmetric with their zero point (folded into each chunk's product on the VNNI
# path), Q4_1 / Q4_K / Q5_1 / Q5_K carry offsets.
GGUF_LIKE = [(8, 32, 128, False), (8, 32, 16, False), (8, 16, 32, False), (4, 32, 8, False),
             (4, 32, 0, True), (8, 32, 0, True), (8, 16, 0, True)]


def _gguf_like(bits, group, zero, offsets, n, k, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(dtype)
    offset = (torch.randn(n, k // group, generator=gen) * 0.05).to(dtype).contiguous() if offsets else None
    return QuantWeight(pack_nibbles(codes) if bits == 4 else codes, scale, offset, bits, group, zero, "test")


@needs_kernel
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("bits, group, zero, offsets", GGUF_LIKE)
@pytest.mark.parametrize("rows", [1, 3, 4, 6])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gguf_like_weights_on_every_path_match_float64(path, bits, group, zero, offsets, rows, dtype):
    """K 640 (an odd number of 64-element chunks, as Gemma 3's hidden size), N not a multiple of
    4 and longer than the tiles' prefetch distance, activations with an outlier channel; scales
    and offsets float16 (the legacy GGUF types) or float32 (the K types)."""
    weight = _gguf_like(bits, group, zero, offsets, n=203, k=640, seed=rows * 7 + bits, dtype=dtype)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 640, generator=gen)
    x[:, 17] *= 60  # one large channel: its block's dx is coarse, the others' are not
    got = quant_linear(x, _for_path(weight, path), None, path)
    want = _rounded_activations(x) @ weight.dequantize().double().T
    assert (got.double() - want).abs().max() <= 3e-5 * want.abs().max()


needs_vnni = pytest.mark.skipif(not lanes_preferred(), reason="the lanes layout's kernel is AVX512-VNNI only")


@needs_vnni
@pytest.mark.parametrize("bits, group, zero, offsets", GGUF_LIKE)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 130])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_lanes_kernel_at_prompt_rows_matches_float64_and_the_rows_layout(bits, group, zero, offsets, rows, dtype):
    """The lanes layout's kernel on the GGUF types as repacked: N not a multiple of its 32-feature
    blocks, rows not of its 4-row tiles, an outlier channel; the float64 product of the same
    rounded activations, and the rows layout's AVX2 path up to float summation order."""
    weight = _gguf_like(bits, group, zero, offsets, n=203, k=640, seed=rows * 7 + bits, dtype=dtype)
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 700, generator=gen)
    x = wide[:, :640]  # rows 700 floats apart: the kernel follows the stride
    x[:, 17] *= 60
    bias = torch.randn(203, generator=gen)
    got = quant_linear(x, weight.to_lanes(), bias)
    want = _rounded_activations(x) @ weight.dequantize().double().T + bias.double()
    assert got.shape == (rows, 203)
    assert (got.double() - want).abs().max() <= 3e-5 * want.abs().max()
    torch.testing.assert_close(got, quant_linear(x, weight, bias, "avx2"), rtol=1e-5,
                               atol=1e-5 * want.abs().max().item())


@needs_vnni
@pytest.mark.parametrize("bits, group", FORMATS)
def test_the_lanes_kernel_takes_every_group_size(bits, group):
    """Groups of 16, 32 and 64+ elements (a group spanning several 32-element activation blocks),
    4- and 8-bit codes, float16 and float32 scales, at decode and prompt row counts."""
    for weight in (_weight(bits, group, n=40, k=256, seed=3), _widened(_weight(bits, group, n=40, k=256, seed=4))):
        for rows in (2, 9):
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(group or 0)) * 3
            want = _rounded_activations(x) @ weight.dequantize().double().T
            assert (quant_linear(x, weight.to_lanes()).double() - want).abs().max() <= 3e-5 * want.abs().max()


@needs_vnni
def test_the_model_takes_the_integer_kernel_past_the_skinny_rows_for_lanes_weights_unless_switched_off(monkeypatch):
    """model/layers.quantized_linear: a lanes weight goes through the integer kernel at every row
    count (integer_prompt), or past max_rows through the dequantized weight in float32; a weight
    one feature a row up to max_rows, and on AVX2 up to _AVX2_INTEGER_ROWS. Both within the
    activations' rounding."""
    from radixserve.model import layers

    rows_layout = _gguf_like(8, 32, 16, False, n=96, k=640, seed=5)
    weight = rows_layout.to_lanes()
    x = torch.randn(layers.max_rows() + 3, 640, generator=torch.Generator().manual_seed(6))
    calls = []
    monkeypatch.setattr(layers, "quant_linear", lambda *a: calls.append(a[0].shape[0]) or quant_linear(*a))
    integer = layers.quantized_linear(x, weight, None, True, True)
    assert calls == [x.shape[0]]
    floats = layers.quantized_linear(x, weight, None, True, False)
    assert calls == [x.shape[0]]  # switched off: not called again
    exact = x.double() @ weight.dequantize().double().T
    torch.testing.assert_close(floats.double(), exact, rtol=1e-5, atol=1e-4)
    assert (integer.double() - exact).abs().max() <= 2e-3 * exact.abs().max()
    layers.quantized_linear(x[:4], weight, None, True, True)
    assert calls == [x.shape[0], 4]
    avx2 = best_path() == "avx2"
    got = layers.quantized_linear(x, rows_layout, None, True, True)
    if avx2:  # one feature a row on AVX2: the integer kernel up to _AVX2_INTEGER_ROWS rows
        assert calls[2:] == [x.shape[0]] and torch.equal(got, quant_linear(x, rows_layout))
    else:  # past max_rows: dequantized
        assert calls == [x.shape[0], 4] and torch.equal(got, floats)
    calls.clear()
    layers.quantized_linear(x, rows_layout, None, True, False)
    assert calls == []  # switched off: dequantized
    many = torch.randn(layers._AVX2_INTEGER_ROWS + 1, 640, generator=torch.Generator().manual_seed(7))
    floats_many = layers.quantized_linear(many, rows_layout, None, True, True)
    assert calls == []  # past the AVX2 integer rows: dequantized
    torch.testing.assert_close(floats_many.double(), many.double() @ rows_layout.dequantize().double().T,
                               rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.skipif(best_path() != "avx2", reason="the AVX2 rule (one feature a row)")
def test_on_avx2_a_4bit_weight_takes_the_integer_kernel_up_to_128_rows(monkeypatch):
    """model/layers.quantized_linear on AVX2: a 4-bit weight one feature a row goes through the
    integer kernel up to _AVX2_INTEGER_ROWS rows (integer_prompt), dequantized past them or when
    switched off; 8-bit codes past max_rows always dequantized."""
    from radixserve.model import layers

    calls = []
    monkeypatch.setattr(layers, "quant_linear", lambda *a: calls.append(a[0].shape[0]) or quant_linear(*a))
    gen = torch.Generator().manual_seed(6)
    rows4, rows8 = _gguf_like(4, 32, 8, False, n=96, k=640, seed=5), _gguf_like(8, 32, 16, False, n=96, k=640, seed=5)
    for rows in (layers.max_rows() + 1, layers._AVX2_INTEGER_ROWS):
        x = torch.randn(rows, 640, generator=gen)
        assert torch.equal(layers.quantized_linear(x, rows4, None, True, True), quant_linear(x, rows4))
        assert calls == [rows]
        calls.clear()
        for weight, integer in ((rows4, False), (rows8, True)):
            floats = layers.quantized_linear(x, weight, None, True, integer)
            assert calls == []
            torch.testing.assert_close(floats.double(), x.double() @ weight.dequantize().double().T, rtol=1e-5,
                                       atol=1e-4)
    many = torch.randn(layers._AVX2_INTEGER_ROWS + 1, 640, generator=gen)
    layers.quantized_linear(many, rows4, None, True, True)
    assert calls == []


@pytest.mark.parametrize("bits, group", FORMATS)
@pytest.mark.parametrize("n", [1, 32, 67])
def test_the_lanes_layout_round_trips_and_puts_each_code_where_documented(bits, group, n):
    """to_lanes / to_rows exactly (N past, at and under a block), padding features zero, and
    code k of feature f at the documented byte: block f // 32, step k // 4 (8-bit) or k // 8
    (4-bit: low nibble for k % 8 < 4), lane f % 32, byte k % 4; scales [block, group, lane]."""
    weight = _weight(bits, group, n=n, k=256, seed=n)
    lanes = weight.to_lanes()
    assert lanes.lanes and lanes.shape == weight.shape == (n, 256) and lanes.nbytes >= weight.nbytes
    back = lanes.to_rows()
    assert not back.lanes and torch.equal(back.codes, weight.codes) and torch.equal(back.scale, weight.scale)
    assert (back.offset is None) == (weight.offset is None)
    if weight.offset is not None:
        assert torch.equal(back.offset, weight.offset)
    u = unpack_codes(weight.codes, bits)
    step_bytes = 4 * LANES
    block_bytes = 256 * LANES * bits // 8
    flat = lanes.codes.reshape(-1)
    gen = torch.Generator().manual_seed(n + bits)
    for f, k in zip(torch.randint(0, n, (40,), generator=gen).tolist(), torch.randint(0, 256, (40,), generator=gen).tolist()):
        step = k // 4 if bits == 8 else k // 8
        byte = int(flat[f // LANES * block_bytes + step * step_bytes + f % LANES * 4 + k % 4])
        code = byte if bits == 8 else (byte & 15 if k % 8 < 4 else byte >> 4)
        assert code == u[f, k]
        assert lanes.scale[f // LANES, k // weight.group, f % LANES] == weight.scale[f, k // weight.group]
    if n % LANES:  # the last block's padding features: zero codes and scales
        steps = lanes.codes.reshape(-1, 256 * bits // 32, LANES, 4)
        assert not steps[-1, :, n % LANES:].any() and not lanes.scale[-1, :, n % LANES:].any()
    assert lanes.to_lanes() is lanes and weight.to_rows() is weight


@needs_kernel
@pytest.mark.parametrize("bits, group", FORMATS)
def test_the_lanes_layout_dequantizes_every_row_exactly(bits, group):
    for weight in (_weight(bits, group, n=67, k=256, seed=9), _widened(_weight(bits, group, n=33, k=256, seed=8))):
        lanes = weight.to_lanes()
        assert torch.equal(lanes.dequantize(), weight.dequantize())
        rows = torch.tensor([weight.shape[0] - 1, 0, 32, 5, 5])
        assert torch.equal(lanes.dequantize(rows), weight.dequantize(rows))
        with pytest.raises(IndexError, match="outside"):
            lanes.dequantize(torch.tensor([weight.shape[0]]))


def test_a_lanes_weight_is_neither_fused_nor_saved_nor_given_a_rows_path():
    weight = _weight(4, 32)
    lanes = weight.to_lanes()
    with pytest.raises(ValueError, match="fuse before"):
        concat_rows([lanes, weight])
    with pytest.raises(ValueError, match="saved as rows"):
        lanes.tensors()
    with pytest.raises(ValueError, match="reads one feature a row"):
        quant_linear(torch.randn(2, 256), lanes, None, "scalar")
    with pytest.raises(ValueError, match="lanes codes need 96 rows"):
        QuantWeight(lanes.codes[:64].contiguous(), lanes.scale, lanes.offset, 4, 32, 0, "", True, 67)


def _every_finite_half() -> torch.Tensor:
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    return bits[torch.isfinite(bits)]


@needs_kernel
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("offsets", [False, True])
def test_every_finite_float16_scale_and_offset_is_read_exactly(path, offsets):
    """Each finite float16 (zeros, subnormals, both signs) as the one scale (and offset) of a
    row: the kernel's product and the dequantized rows are that value widened, on the path's
    conversion (the scalar code's own, F16C in the vector paths)."""
    halves = _every_finite_half()
    n = halves.numel()
    codes = torch.ones(n, 64, dtype=torch.uint8)
    scale = halves.reshape(n, 1).contiguous()
    offset = halves.flip(0).reshape(n, 1).contiguous() if offsets else None
    weight = _for_path(QuantWeight(codes, scale, offset, 8, 64, 0, "test"), path)
    value = scale.float() + (0 if offset is None else offset.float())  # u = 1 everywhere
    assert torch.equal(weight.dequantize(), value.expand(n, 64))
    assert torch.equal(weight.dequantize(torch.tensor([0, n - 1])), value[[0, n - 1]].expand(2, 64))
    # x = 1: dx = 1/127, every high code 127, no residual; the row sums 64 * (scale + offset)
    got = quant_linear(torch.ones(1, 64), weight, None, path)[0].double()
    want = 64 * value[:, 0].double()
    size = 64 * (scale.double().abs() + (0 if offset is None else offset.double().abs()))[:, 0]
    assert ((got - want).abs() <= 1e-6 * size).all()


@needs_kernel
def test_paths_agree_and_zero_rows_give_zero():
    weight = _weight(4, 32)
    x = torch.zeros(3, 256)
    x[1] = torch.linspace(-2, 2, 256)
    outs = {p: quant_linear(x, _for_path(weight, p), None, p) for p in PATHS}
    assert torch.equal(outs["best"][0], torch.zeros(67))
    for out in outs.values():
        torch.testing.assert_close(out, outs["scalar"], rtol=1e-4, atol=1e-4)


@needs_kernel
def test_dequantize_rows_and_a_bad_row_index():
    weight = _weight(8, 16)
    full = weight.dequantize()
    torch.testing.assert_close(full, weight._dequantize_torch(None), rtol=0, atol=1e-6)
    rows = torch.tensor([5, 0, 66, 5])
    assert torch.equal(weight.dequantize(rows), full[rows])
    with pytest.raises(IndexError, match="outside"):
        weight.dequantize(torch.tensor([67]))


def test_the_layout_refuses_what_the_kernel_cannot_take():
    codes = torch.zeros(2, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="K % 64"):
        QuantWeight(torch.zeros(2, 48, dtype=torch.uint8), torch.zeros(2, 3), None, 8, 32)
    with pytest.raises(ValueError, match="group"):
        QuantWeight(codes, torch.zeros(2, 3), None, 8, 24)
    with pytest.raises(ValueError, match="scale must be"):
        QuantWeight(codes, torch.zeros(2, 3), None, 8, 32)
    with pytest.raises(ValueError, match="scale must be contiguous float16 or float32"):
        QuantWeight(codes, torch.zeros(2, 2, dtype=torch.bfloat16), None, 8, 32)
    with pytest.raises(ValueError, match="offset must be torch.float16 as scale is"):
        QuantWeight(codes, torch.zeros(2, 2, dtype=torch.float16), torch.zeros(2, 2), 8, 32)


def test_nibble_packing_round_trips():
    u = torch.randint(0, 16, (3, 128), dtype=torch.uint8)
    packed = pack_nibbles(u)
    assert packed.shape == (3, 64)
    assert torch.equal(unpack_codes(packed, 4), u)
    assert torch.equal(packed[0, 5], u[0, 5] | (u[0, 37] << 4))  # byte j: code j low, code 32 + j high


def test_fusing_mixed_storage_keeps_every_value():
    parts = [_weight(4, 32, n=8, seed=1), _weight(8, None, n=4, seed=2), _weight(8, 16, n=6, seed=3)]
    fused = concat_rows(parts)
    assert (fused.bits, fused.group, fused.shape) == (8, 16, (18, 256))
    want = torch.cat([p.dequantize() for p in parts])
    torch.testing.assert_close(fused.dequantize(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtypes, fused_dtype", [
    ((torch.float16, torch.float16), torch.float16),
    ((torch.float16, torch.float32), torch.float32),
    ((torch.float32, torch.float16), torch.float32),
])
def test_fusing_float16_and_float32_scales_is_exact(dtypes, fused_dtype):
    """Parts of both scale dtypes fuse in float32; float16 parts stay float16, zero points
    turned into offsets included (Q4_0's 8 and Q8_0's 128 beside Q4_1's offsets)."""
    parts = [_gguf_like(4, 32, 8, False, 8, 256, seed=1, dtype=dtypes[0]),
             _gguf_like(8, 32, 128, False, 4, 256, seed=2, dtype=dtypes[1]),
             _gguf_like(4, 32, 0, True, 4, 256, seed=3, dtype=dtypes[1])]
    fused = concat_rows(parts)
    assert fused.scale.dtype == fused.offset.dtype == fused_dtype
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    torch.testing.assert_close(fused._dequantize_torch(None), fused.dequantize(), rtol=0, atol=1e-6)


def test_fusing_float16_parts_whose_offsets_float16_cannot_hold_widens():
    """-zero * scale past float16's range (a scale over 65504 / 128): float32, values unchanged."""
    big = _gguf_like(8, 32, 128, False, 2, 64, seed=4, dtype=torch.float16)
    big.scale[0, 0] = 1024.0
    parts = [big, _gguf_like(4, 32, 0, True, 2, 64, seed=5, dtype=torch.float16)]
    fused = concat_rows(parts)
    assert fused.scale.dtype == torch.float32
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_saved_tensors_keep_their_dtype(tmp_path):
    from safetensors.torch import load_file, save_file

    for weight in (_weight(4, 32), _widened(_weight(8, None))):
        save_file(weight.tensors(), str(tmp_path / "w.safetensors"))
        back = QuantWeight.from_saved(load_file(str(tmp_path / "w.safetensors")), weight.meta())
        assert back.scale.dtype == weight.scale.dtype and torch.equal(back.dequantize(), weight.dequantize())


def test_quantize_at_load_stays_within_half_a_step():
    w = torch.randn(16, 128)
    w[3] *= 1e-4  # scales in float16's subnormal range
    for bits, group in ((8, None), (4, None), (4, 64)):
        q = quantize(w, bits, group)
        assert q.scale.dtype == torch.float16 and (q.offset is None or q.offset.dtype == torch.float16)
        step = q.scale.float().repeat_interleave(q.group, dim=1)
        assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6 * step).all()
    assert quantize(w, 8).group == 128 and quantize(w, 4).group == 32
    with pytest.raises(ValueError, match="8 or 4 bits"):
        quantize(w, 3)


def test_quantize_keeps_float32_scales_past_float16s_range():
    w = torch.randn(4, 64)
    w[1, 5] = 1e7  # int8: a scale of ~79,000; int4: a range of 1e7 / 15
    for bits in (8, 4):
        q = quantize(w, bits)
        assert q.scale.dtype == torch.float32
        step = q.scale.repeat_interleave(q.group, dim=1)
        assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6 * step).all()


def test_a_product_of_no_rows_dequantizes_nothing(monkeypatch):
    """A step whose prompt chunks sample nothing hands the head zero rows: an empty result,
    not the whole vocabulary dequantized slice by slice (and the buffer grown to a slice)."""
    from radixserve.model.layers import quantized_linear

    weight = _weight(4, 32)
    monkeypatch.setattr(QuantWeight, "dequantize", lambda *a, **k: pytest.fail("dequantized for no rows"))
    out = quantized_linear(torch.empty(0, 256), weight, torch.zeros(67))
    assert out.shape == (0, 67) and out.dtype == torch.float32


def test_the_dequantization_buffer_is_let_go_at_a_trim_and_made_again():
    """Kept from call to call while the engine works; an idle engine's trim lets it go (its
    pages back to the system) and the next product past the kernel's rows makes a new one."""
    from radixserve.kernels.heap import return_freed_memory
    from radixserve.kernels.native_ops import max_rows
    from radixserve.model import layers

    weight = _weight(4, 32)
    x = torch.randn(max(max_rows(), 1) + 1, 256)  # past the integer kernels (the prompt one off): dequantized
    first = layers.quantized_linear(x, weight, integer_prompt=False)
    assert layers._scratch.buffer is not None
    return_freed_memory()
    assert layers._scratch.buffer is None
    assert torch.equal(layers.quantized_linear(x, weight, integer_prompt=False), first)
    assert layers._scratch.buffer is not None


@needs_kernel
@pytest.mark.parametrize("path", list(PATHS))
def test_activations_round_half_to_even_in_both_codes(path):
    """Rows whose max is 127 (so dx = 1 exactly) and whose elements are halfway cases: the high
    code rounds half to even (2.5 -> 2, 3.5 -> 4), the residual in 1/256ths too and is clamped
    to +-127 (0.5 * 256 = 128 -> 127), as the float64 reference does. Against an all-ones weight
    the product is the sum of the rounded row, so a truncating or half-away rounding shows."""
    halves = torch.tensor([2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5, 126.5], dtype=torch.float32)
    block = torch.cat([torch.tensor([127.0]), halves.repeat(3), torch.full((7,), 0.25)])  # 32 elements
    x = block.repeat(2).reshape(1, 64)
    x = torch.cat([x, -x.flip(1)])  # a second row, negated, each block's 127 at its end
    weight = _for_path(QuantWeight(torch.full((3, 64), 129, dtype=torch.uint8), torch.ones(3, 2, dtype=torch.float16),
                                   None, 8, 32, 128, "test"), path)  # every value (129 - 128) * 1 = 1
    got = quant_linear(x, weight, None, path)
    want = _rounded_activations(x).sum(1, keepdim=True).expand(2, 3)
    assert _rounded_activations(x)[0, 1] == 2.0 + 127 / 256 and _rounded_activations(x)[0, 2] == 4.0 - 127 / 256
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)
    truncated = x.trunc().sum(1, keepdim=True).double()
    assert ((got.double() - truncated[:, :1]).abs() > 0.1).all()


@needs_kernel
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("bits, group", [(4, 32), (4, 16), (4, 64), (8, 32), (8, 16), (8, None)])
def test_a_rows_result_is_the_same_floats_whatever_rows_beside_it(path, bits, group):
    """Batch invariance at the kernel: each row of a 1-, 3-, 8- and 19-row product (the single-row
    tiles, a partial row tile, a full one, and past it) equals that row's product alone, bit for bit."""
    weight = _for_path(_weight(bits, group, n=70, k=192), path)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(19, 192, generator=gen) * torch.rand(19, 192, generator=gen) * 3
    alone = torch.cat([quant_linear(x[r:r + 1], weight, None, path) for r in range(19)])
    for rows in (3, 8, 19):
        assert torch.equal(quant_linear(x[:rows], weight, None, path), alone[:rows]), rows
