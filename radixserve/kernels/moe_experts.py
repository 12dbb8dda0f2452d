"""QuantExperts: a mixture of experts' quantized weights, and the one C call
(csrc/moe_experts.c) that routes a step's rows, groups them per expert and runs each selected
expert's gate/up, SiLU gate and down over its rows only, summing each row's experts' outputs.

The experts stay as they were loaded (one QuantWeight per expert and projection, gate/up fused,
in the rows or lanes layout): the kernel gets their addresses, so nothing is copied. Every expert
of a projection must share one storage (bits, group, zero point, scale dtype, offsets, layout),
as a GGUF's stacked expert tensor does; `QuantExperts.build` returns None otherwise and the
model keeps its per-expert path (model/moe.py), which is also the reference the kernel is tested
against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from radixserve.kernels.native_build import load_kernel
from radixserve.kernels.native_ops import model_ops_enabled
from radixserve.kernels.quant_linear import PATHS, QuantWeight

MAX_TOP_K = 64  # experts a row selects at most (csrc/moe_experts.c's MAX_TOP_K): more take the per-expert path


@dataclass
class QuantExperts:
    gate_up: list[QuantWeight]  # per expert [2I, H]: gate rows, then up rows
    down: list[QuantWeight]  # per expert [H, I]
    gate_up_ptrs: torch.Tensor  # int64 [3, E]: codes, scales, offsets (0: none)
    gate_up_meta: torch.Tensor  # int64 [7]: N, K, bits, group, zero, half, lanes
    down_ptrs: torch.Tensor
    down_meta: torch.Tensor

    @classmethod
    def build(cls, gate_up: list[QuantWeight], down: list[QuantWeight], top_k: int) -> QuantExperts | None:
        """The kernel's view of the experts a layer selects top_k of per row, or None where it
        cannot take them (no kernel here, experts stored unlike each other, shapes that do not
        chain, more than MAX_TOP_K selected)."""
        if (_kernel("moe_experts_f32") is None or len(gate_up) != len(down) or not gate_up
                or not 0 < top_k <= min(MAX_TOP_K, len(gate_up))):
            return None
        gu, dn = _describe(gate_up), _describe(down)
        if gu is None or dn is None:
            return None
        (gu_n, hidden), (dn_n, inter) = gate_up[0].shape, down[0].shape
        if gu_n != 2 * inter or dn_n != hidden:
            return None
        return cls(gate_up, down, gu[0], gu[1], dn[0], dn[1])

    def __call__(self, x: torch.Tensor, logits: torch.Tensor, top_k: int, normalize: bool,
                 counts: torch.Tensor | None = None, path: str = "best") -> torch.Tensor | None:
        """The layer's output [T, H] for x [T, H] and the router's logits [T, E] (float32 CPU rows),
        or None where the kernel does not take them. counts (int64 [E]) receives the rows each
        expert multiplied."""
        experts = len(self.gate_up)
        if not (0 < top_k <= min(MAX_TOP_K, experts) and x.dim() == 2 and logits.dim() == 2 and x.dtype == logits.dtype == torch.float32
                and x.device.type == logits.device.type == "cpu" and x.stride(1) == 1 and logits.stride(1) == 1
                and logits.shape == (x.shape[0], experts) and x.shape[0] > 0
                and x.shape[1] == int(self.gate_up_meta[1])):
            return None
        if counts is not None and not (counts.dtype == torch.int64 and counts.shape == (experts,)
                                       and counts.is_contiguous()):
            raise ValueError(f"counts must be contiguous int64 [{experts}]")
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        status = _kernel("moe_experts_f32")(
            x.data_ptr(), x.shape[0], x.stride(0), logits.data_ptr(), logits.stride(0), experts, top_k,
            int(normalize), self.gate_up_ptrs.data_ptr(), self.gate_up_meta.data_ptr(), self.down_ptrs.data_ptr(),
            self.down_meta.data_ptr(), out.data_ptr(), out.stride(0), None if counts is None else counts.data_ptr(),
            PATHS[path])
        if status == -3:
            raise ValueError(f"this build of the MoE kernel has no {path} path for these experts' layout")
        if status:
            raise RuntimeError(f"moe_experts_f32 failed ({status}) on {experts} experts of {self.gate_up[0].kind}")
        return out


def _describe(weights: list[QuantWeight]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The experts' addresses [3, E] and their one storage [7], or None where they differ."""
    first = weights[0]
    storage = (first.shape, first.bits, first.group, first.zero, first.half_scales, first.lanes,
               first.offset is None)
    if any((w.shape, w.bits, w.group, w.zero, w.half_scales, w.lanes, w.offset is None) != storage
           for w in weights):
        return None
    ptrs = torch.tensor([[w.codes.data_ptr() for w in weights], [w.scale.data_ptr() for w in weights],
                         [0 if w.offset is None else w.offset.data_ptr() for w in weights]], dtype=torch.int64)
    n, k = first.shape
    meta = torch.tensor([n, k, first.bits, first.group, first.zero, int(first.half_scales), int(first.lanes)],
                        dtype=torch.int64)
    return ptrs, meta


@functools.cache
def _kernel(name: str):
    return load_kernel(name) if model_ops_enabled() else None
