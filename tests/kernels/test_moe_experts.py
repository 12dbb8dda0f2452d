"""The MoE kernel (csrc/moe_experts.c through kernels/moe_experts.py) against the model's
per-expert torch path (model/moe.py's forward_per_expert: routing in torch, each expert through
the quantized matmul kernel), on small shapes, every storage the GGUF types repack to, every
path; and the rows it reports each expert multiplied against torch's routing."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.moe_experts import MAX_TOP_K, QuantExperts
from radixserve.kernels.quant_linear import PATHS, QuantWeight, best_path, lanes_preferred, pack_nibbles, quantize
from radixserve.model.moe import SparseMoE

needs_kernel = pytest.mark.skipif(best_path() is None, reason="no C compiler here")
E, H, I = 8, 128, 64

# (bits, group, zero, offsets, scale dtype): Q4_0, Q8_0, Q4_K / Q4_1 (offsets), Q6_K (16-element
# groups, float32 scales), int8 per channel (zero point 128), int4 quantized at load
STORAGES = {
    "Q4_0": (4, 32, 8, False, torch.float16), "Q8_0": (8, 32, 128, False, torch.float16),
    "Q4_K": (4, 32, 0, True, torch.float32), "Q6_K": (8, 16, 32, False, torch.float32),
}


def _gguf_like(bits, group, zero, offsets, dtype, n, k, gen) -> QuantWeight:
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=gen) * 0.05 + 0.01).to(dtype)
    offset = (torch.randn(n, k // group, generator=gen) * 0.1).to(dtype) if offsets else None
    return QuantWeight(pack_nibbles(codes) if bits == 4 else codes, scale.contiguous(), offset,
                       bits, group, 0 if offsets else zero)


def _mxfp4(n: int, k: int, gen) -> QuantWeight:
    """gpt-oss's MXFP4 as repacked (8-bit codes 2v + 128, float32 scales 2^(e - 128))."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from radixserve.model.gguf_repack import repack

    values = (torch.randn(n, k, generator=gen) * 0.2).numpy()
    return repack("MXFP4", np.asarray(quants.quantize(values, GGMLQuantizationType.MXFP4)), n, k)


def _moe(storage: str, path: str, seed: int = 0, top_k: int = 2, experts: int = E) -> SparseMoE:
    gen = torch.Generator().manual_seed(seed)
    E = experts
    moe = SparseMoE(H, I, E, top_k, normalize=True)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 1.0, generator=gen)
    moe.drop_float_experts()
    if storage == "MXFP4":
        gate, up, down = _mxfp4(E * I, H, gen), _mxfp4(E * I, H, gen), _mxfp4(E * H, I, gen)
    elif storage in STORAGES:
        gate = _gguf_like(*STORAGES[storage], E * I, H, gen)
        up = _gguf_like(*STORAGES[storage], E * I, H, gen)
        down = _gguf_like(*STORAGES[storage], E * H, I, gen)
    else:
        bits = {"int8": 8, "int4": 4}[storage]
        gate, up, down = (quantize(torch.randn(rows, k, generator=gen) * 0.2, bits)
                          for rows, k in ((E * I, H), (E * I, H), (E * H, I)))
    moe.load_experts(gate, up, down)
    if top_k > MAX_TOP_K:
        return moe
    if path != "best" and moe.quant_gate_up[0].lanes:  # the AVX2 and scalar paths read rows
        moe.quant_gate_up = [w.to_rows() for w in moe.quant_gate_up]
        moe.quant_down = [w.to_rows() for w in moe.quant_down]
        moe.native = QuantExperts.build(moe.quant_gate_up, moe.quant_down, moe.top_k)
    assert moe.native is not None
    return moe


def _reference(moe: SparseMoE, x: torch.Tensor, path: str) -> torch.Tensor:
    if path == "best":
        return moe.forward_per_expert(x, moe.gate(x))
    from radixserve.kernels import quant_linear as ql

    original = ql.quant_linear
    ql_path = lambda x, w, bias=None, p="best": original(x, w, bias, path)  # noqa: E731
    import radixserve.model.layers as layers

    layers.quant_linear, saved = ql_path, layers.quant_linear
    try:
        return moe.forward_per_expert(x, moe.gate(x))
    finally:
        layers.quant_linear = saved


@needs_kernel
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("storage", [*STORAGES, "MXFP4", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 8, 20])
def test_one_call_equals_an_expert_at_a_time(storage, path, rows):
    moe = _moe(storage, path, seed=rows)
    gen = torch.Generator().manual_seed(50 + rows)
    wide = torch.randn(rows, 2 * H, generator=gen)
    x = wide[:, :H]  # rows 2H floats apart: the kernel follows the stride
    counts = torch.zeros(E, dtype=torch.int64)
    got = moe.native(x, moe.gate(x), moe.top_k, moe.normalize, counts, path)
    want = _reference(moe, x, path)
    assert got.shape == (rows, H)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    _, chosen = torch.topk(torch.softmax(moe.gate(x), dim=-1), moe.top_k, dim=-1)
    assert counts.tolist() == torch.bincount(chosen.reshape(-1), minlength=E).tolist()  # only these were read


@needs_kernel
def test_the_layer_takes_the_call_at_decode_sizes_and_an_expert_at_a_time_past_them():
    from radixserve.kernels.native_ops import max_rows

    moe = _moe("Q4_0", "best", top_k=3)
    calls = []
    original = moe.expert
    moe.expert = lambda e, h: calls.append(e) or original(e, h)
    x = torch.randn(4, H)
    got = moe(x)
    assert calls == []  # one C call
    assert (got - moe.forward_per_expert(x, moe.gate(x))).abs().max() <= 1e-5 * got.abs().max()
    if not lanes_preferred():
        calls.clear()
        moe(torch.randn(max(max_rows(), 1) + 1, H))
        assert calls and calls == sorted(set(calls))  # a prompt-sized step: each selected expert once


@needs_kernel
def test_refusals_change_nothing():
    moe = _moe("Q8_0", "best")
    x = torch.randn(2, H)
    assert moe.native(x.double(), moe.gate(x).double(), 2, True) is None
    assert moe.native(x, moe.gate(x)[:, :4].contiguous(), 2, True) is None
    with pytest.raises(ValueError, match="counts"):
        moe.native(x, moe.gate(x), 2, True, torch.zeros(3, dtype=torch.int64))
    mixed = moe.quant_down[:-1] + [quantize(torch.randn(H, I), 4)]
    assert QuantExperts.build(moe.quant_gate_up, mixed, 2) is None  # experts stored unlike each other


@needs_kernel
def test_more_experts_a_row_than_the_call_takes_run_an_expert_at_a_time():
    """Past MAX_TOP_K selected experts a row the layer has no C call (the native decoder then
    keeps the layer path) and gives the per-expert result; at MAX_TOP_K it takes the call."""
    x = torch.randn(3, H)
    at_limit = _moe("Q8_0", "best", top_k=MAX_TOP_K, experts=MAX_TOP_K + 16)
    assert at_limit.native is not None
    assert at_limit.native(x, at_limit.gate(x), MAX_TOP_K + 1, True) is None  # a call past it: refused, not run
    past = _moe("Q8_0", "best", top_k=MAX_TOP_K + 1, experts=MAX_TOP_K + 16)
    assert past.native is None
    got = past(x)
    assert torch.equal(got, past.forward_per_expert(x, past.gate(x))) and torch.isfinite(got).all()
