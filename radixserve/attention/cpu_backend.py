"""CpuAttentionBackend: paged attention on CPU with the C kernels of kernels/csrc/.

Each layer: the store kernel writes the step's new K/V into their slots; the decode
kernel (paged_attention.c) attends every single-token request over its context in place
through its block table (no gather), reading the blocks that neighbouring requests share
once for all of them (the runner orders decodes by block table); all of a step's prefill
chunks, whole prompts and extends over a cached prefix alike, run one call of the tiled
kernel (prefill_attention.c), which also reads the pool in place. With `tiled_prefill`
off, chunks run torch's SDPA over gathered pages, one call each, as in the torch backend
(the reference, to compare). With `bf16_prefill` on (CPUs with AVX512_BF16) the tiled
kernel takes its two products' inputs in bfloat16, about half its time; the softmax and the sums
stay float32. The kernels take float32 pools and int8 pages
(kernels/quantized_pages.py: the store quantizes, attention dequantizes as it reads); with a
pool of another dtype the backend runs the torch backend's paths throughout (and says so once).
A sliding-window layer passes its window to both kernels, which start at each row's first
window block (decode cost O(window)); SDPA's chunks get window masks, made once per window a step.
A layer's attention sinks (gpt-oss) go to every path: both kernels fold them in after a row's
last key. A step's draft-tree masks (attention/metadata.py) go to the decode kernel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from radixserve.attention.backend import AttentionBackend, AttentionOptions, AttentionPlan
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.torch_backend import (
    PrefillChunk, TorchAttentionBackend, plan_prefills, prefill_attention, store_kv,
)
from radixserve.kernels.quantized_pages import QuantizedPages, dequantize
from radixserve.kernels.native_attention import load_native_attention

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TiledChunks:
    """A step's prefill chunks for the tiled kernel: requests num_decodes on."""

    block_tables: torch.Tensor  # [C, max_blocks] int32
    query_start: torch.Tensor  # [C + 1] int32, rows of the step's q
    seq_lens: torch.Tensor  # [C] int32


@dataclass(frozen=True)
class CpuPlan(AttentionPlan):
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [D] int32
    prefills: list[PrefillChunk]  # for SDPA; empty where `tiled` holds the chunks
    tiled: TiledChunks | None = None
    meta: AttentionMetadata | None = None
    windows: dict[int, list[PrefillChunk]] = field(default_factory=dict, compare=False)  # SDPA's chunks per window
    decode_tree_masks: torch.Tensor | None = None  # [D] int64: the decodes' draft-tree masks, or None


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype = torch.float32, pages: QuantizedPages | None = None, tiled_prefill: bool = True,
                 bf16_prefill: bool = False):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, dtype, pages)
        self._kernels = load_native_attention()
        if self._kernels is None:
            raise RuntimeError("the cpu attention backend's C kernels could not be built here (see the "
                               "warning above); use attention_backend='torch'")
        self.tiled_prefill = tiled_prefill
        self._torch: TorchAttentionBackend | None = None
        if dtype != torch.float32:
            logger.info("cpu attention backend: the C kernels are float32; %s runs the torch paths", dtype)
            self._torch = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale, dtype, pages)
        self.bf16_prefill = False
        self.use_bf16_prefill(bf16_prefill)

    def configure(self, options: AttentionOptions) -> None:
        self.tiled_prefill = options.tiled_prefill
        self.use_bf16_prefill(options.prefill_dtype == "bfloat16")

    def use_bf16_prefill(self, on: bool) -> None:
        """Prompt attention's products in bfloat16 (on) or float32; refused, changing nothing,
        where the tiled kernel cannot take them."""
        missing = self._bf16_prefill_missing() if on else []
        if missing:
            raise ValueError(f"prefill_attention_dtype bfloat16 needs {'; '.join(missing)}: use float32")
        self.bf16_prefill = on

    def _bf16_prefill_missing(self) -> list[str]:
        missing = []
        if not self.runs_kernels:
            missing.append("float32 activations (the C kernels)")
        if not self.tiled_prefill:
            missing.append("the tiled prompt kernel (tiled_prefill_attention)")
        if not self._kernels.has_bf16_prefill(self.head_dim):
            missing.append(f"a CPU with AVX512_BF16 and a head_dim that is a multiple of 32 (head_dim {self.head_dim})")
        return missing

    @property
    def runs_kernels(self) -> bool:
        """Whether attention runs the C kernels (float32 activations) rather than the torch paths."""
        return self._torch is None

    @property
    def takes_strided_rows(self) -> bool:
        return self.runs_kernels

    @property
    def hosts_native_decoder(self) -> bool:
        return self.runs_kernels

    def prepare(self, meta: AttentionMetadata) -> AttentionPlan:
        if self._torch is not None:
            return self._torch.prepare(meta)
        d = meta.num_decodes
        decodes = (d, meta.slot_mapping, meta.block_tables[:d], meta.seq_lens[:d])
        masks = None if meta.tree_masks is None else meta.tree_masks[:d].contiguous()
        if d == meta.num_requests or not (self.tiled_prefill and self._kernels.has_prefill):
            return CpuPlan(*decodes, plan_prefills(meta), meta=meta, decode_tree_masks=masks)
        chunks = TiledChunks(meta.block_tables[d:], meta.query_start_loc[d:], meta.seq_lens[d:])
        return CpuPlan(*decodes, [], chunks, meta=meta, decode_tree_masks=masks)

    def forward(self, q, k, v, k_cache, v_cache, plan: AttentionPlan, window: int = 0, sinks=None) -> torch.Tensor:
        if self._torch is not None:
            return self._torch.forward(q, k, v, k_cache, v_cache, plan, window, sinks)
        q, k, v = _dense_heads(q), _dense_heads(k), _dense_heads(v)
        pages = self.pages
        if self._kernels.store(k, v, k_cache, v_cache, plan.slot_mapping, pages):
            if pages is not None and plan.prefills:  # SDPA's chunks: their fresh K/V as the pages hold them
                k, v = _read_back(pages, k_cache, v_cache, plan.slot_mapping, q.dtype)
        else:
            k, v = store_kv(k, v, k_cache, v_cache, plan.slot_mapping, pages)
        out = torch.empty(q.shape, dtype=q.dtype)
        d = plan.num_decodes
        if d:
            out[:d] = self._kernels.decode(
                q[:d].contiguous(), k_cache, v_cache, plan.decode_block_tables, plan.decode_seq_lens, self.scale,
                pages, window, sinks, plan.decode_tree_masks,
            )
        if plan.tiled is not None:
            chunks = plan.tiled
            self._kernels.prefill(q, k_cache, v_cache, chunks.block_tables, chunks.query_start, chunks.seq_lens,
                                  self.scale, out, pages, self.bf16_prefill, window, sinks)
        for chunk in _sdpa_chunks(plan, window):
            out[chunk.start : chunk.end] = prefill_attention(q, k, v, k_cache, v_cache, chunk, self.scale, pages,
                                                             sinks)
        return out


def _dense_heads(t: torch.Tensor) -> torch.Tensor:
    """t [T, H, d] as the kernels take it: heads dense within each token row (rows may be
    strided), else a contiguous copy (a column-major product's views)."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.stride(0) >= t.shape[1] * t.shape[2] \
        else t.contiguous()


def _sdpa_chunks(plan: CpuPlan, window: int) -> list[PrefillChunk]:
    """The plan's SDPA chunks for layers of this sliding window (0: the plan's own)."""
    if window <= 0 or not plan.prefills:
        return plan.prefills
    if window not in plan.windows:
        plan.windows[window] = plan_prefills(plan.meta, window)
    return plan.windows[window]


def _read_back(pages: QuantizedPages, k_pages, v_pages, slots, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    blocks, offsets = slots // pages.block_size, slots % pages.block_size
    return tuple(
        dequantize(pages.codes(p)[blocks, offsets], pages.scales(p)[blocks, offsets], dtype) for p in (k_pages, v_pages)
    )
