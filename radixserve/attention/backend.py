"""AttentionBackend: the interface the model calls for paged attention, and AttentionPlan,
what a backend derives once per step for every layer to read."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from radixserve.kernels.quantized_pages import QuantizedPages
from radixserve.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionPlan:
    """One step's attention, ready for every layer: made by `prepare` from the step's
    AttentionMetadata, read by `forward`. Each backend extends it with what it precomputes."""

    num_decodes: int  # the first rows are single-token requests; prefill chunks follow
    slot_mapping: torch.Tensor  # [T] int64: the flat pool slot of each new token's K/V


@dataclass(frozen=True)
class GroupPlans:
    """A hybrid KV step's plans: one over the full layers' blocks, one over the window
    layers' pages (their own block tables and slots; see core/window_pages.py)."""

    full: AttentionPlan
    window: AttentionPlan


@dataclass(frozen=True)
class AttentionOptions:
    """The engine's attention choices that a backend reads in `configure` (each its own)."""

    tiled_prefill: bool = True  # cpu: prompt chunks through the tiled kernel, else torch's SDPA
    prefill_dtype: str = "float32"  # cpu: "bfloat16" takes the tiled kernel's products in bfloat16


def plan_for(plan: AttentionPlan | GroupPlans, window: int) -> AttentionPlan:
    """The plan a layer with this window reads."""
    if isinstance(plan, GroupPlans):
        return plan.window if window else plan.full
    return plan


class AttentionBackend(abc.ABC):
    """Writes a step's new K/V into the paged pool, then attends over each request's
    context through its block table. Query head h reads KV head h // (num_heads // num_kv_heads).

    Caches are one layer's pool: [num_blocks, block_size, num_kv_heads, head_dim] of
    `dtype`, or with `pages` (quantized KV) its [num_blocks, page_bytes] uint8 pages, of
    a code in `page_codes`. q is
    [T, num_heads, head_dim]; k and v are [T, num_kv_heads, head_dim]; the result has q's shape.

    A layer with a sliding window W > 0 (Gemma 2/3, Mistral) has the query at context
    position p attend keys j with p - W < j <= p; W = 0 is full causal attention. A step's
    plan serves every layer whatever its window. Block-table entries of blocks that lie wholly
    before every one of a request's query windows are never read (a hybrid KV layout frees
    those pages and leaves any value there).
    """

    name = "abstract"
    page_codes: tuple[str, ...] = ("int8",)  # the quantized pages this backend reads

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype = torch.float32, pages: QuantizedPages | None = None):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if pages is not None and pages.code.name not in self.page_codes:
            raise ValueError(f"the {self.name} attention backend reads {' and '.join(self.page_codes)} KV pages, "
                             f"not {pages.code.name}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.dtype = dtype
        self.pages = pages

    def configure(self, options: AttentionOptions) -> None:
        """Take the options this backend reads; refuse (ValueError) one it cannot honour.
        A backend that reads none refuses a prompt attention dtype other than float32."""
        if options.prefill_dtype != "float32":
            raise ValueError(f"prefill_attention_dtype {options.prefill_dtype} is read by the cpu attention "
                             f"backend only; this engine runs {self.name}")

    @property
    def takes_strided_rows(self) -> bool:
        """Whether forward takes q, k and v whose token rows are strided (views of the fused
        qkv rows, heads dense within a row) as they are; else the model makes them contiguous."""
        return False

    @property
    def hosts_native_decoder(self) -> bool:
        """Whether the model's native C decoder (model/native_decoder.py) may run beside this
        backend: it reads and writes the pool exactly as this backend's C kernels do."""
        return False

    @abc.abstractmethod
    def prepare(self, meta: AttentionMetadata) -> AttentionPlan:
        """Called once per step before the first layer: everything per-step goes in the plan."""

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: AttentionPlan,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store k/v at plan.slot_mapping, return attention output [T, num_heads, head_dim].
        `plan` is what this backend's prepare returned for the step; `window` this layer's
        sliding window (0: full causal attention); `sinks` this layer's attention sinks (gpt-oss:
        float32 [num_heads], each head's softmax denominator also counts exp(sink); None: none)."""
