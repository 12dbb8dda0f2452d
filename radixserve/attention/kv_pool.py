"""KVPool: the paged K/V tensors of every layer, in the model's dtype or as quantized (int8, fp8) pages."""

from __future__ import annotations

import math
import mmap

import torch

from radixserve.kernels.quantized_pages import QuantizedPages, page_code


class KVPool:
    """K and V for every layer in one tensor of shape
    [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] of `dtype`; with
    kv_cache_dtype int8 or fp8_e4m3, [num_layers, 2, num_blocks, page_bytes] uint8
    (quantized_pages.py: a block's codes and scales in one page). Either way kv[:, :, b] is block b's whole KV,
    which the tier and persistence copy as opaque bytes.

    Hybrid KV (`window_layers` and `num_window_pages` given): those layers' K/V live apart,
    in `window_kv` of [len(window_layers), 2, num_window_pages, ...], indexed by window page
    (core/window_pages.py), and `kv` holds only the other (full) layers."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
        window_layers: tuple[int, ...] = (),
        num_window_pages: int = 0,
        prefault: bool = False,
    ):
        self.kv_cache_dtype = kv_cache_dtype
        self.block_size = block_size
        code = page_code(kv_cache_dtype)
        self.pages = QuantizedPages(block_size, num_kv_heads, head_dim, code) if code else None
        self.rotate_keys = code is not None  # quantized pages hold keys in kernels/key_basis.py's basis
        full_layers = [i for i in range(num_layers) if i not in window_layers]
        shape, storage = self.geometry(len(full_layers), block_size, num_kv_heads, head_dim, dtype, kv_cache_dtype)
        self.kv, self._memory = _zeros((*shape[:2], num_blocks, *shape[2:]), storage, torch.device(device),
                                       prefault)
        self.block_bytes = math.prod(shape) * self.kv.element_size()
        self.bytes_per_token = self.block_bytes / block_size
        views = {layer: (self.kv[i, 0], self.kv[i, 1]) for i, layer in enumerate(full_layers)}
        self.window_kv, self.window_page_bytes = None, 0
        if window_layers:
            page, _ = self.geometry(len(window_layers), block_size, num_kv_heads, head_dim, dtype, kv_cache_dtype)
            self.window_kv, self._window_memory = _zeros((*page[:2], num_window_pages, *page[2:]), storage,
                                                         torch.device(device), prefault)
            self.window_page_bytes = math.prod(page) * self.kv.element_size()
            views.update({layer: (self.window_kv[i, 0], self.window_kv[i, 1]) for i, layer in enumerate(window_layers)})
        self._layers = [views[i] for i in range(num_layers)]  # views, made once
        self._numpy_copies = self.kv.device.type == "cpu" and self.kv.dtype != torch.bfloat16

    @property
    def hybrid(self) -> bool:
        return self.window_kv is not None

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[index]

    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block's K/V over all layers: [num_layers, 2, block_size, heads, dim]."""
        shape = self.kv.shape
        return (shape[0], shape[1], *shape[3:])

    def page_shape(self) -> tuple[int, ...]:
        """Shape of one window page's K/V over the window layers (hybrid KV)."""
        shape = self.window_kv.shape
        return (shape[0], shape[1], *shape[3:])

    def copy_blocks_out(self, blocks: list[int], dest: torch.Tensor, slots: list[int]) -> None:
        """dest[slot] = the K/V of pool block `block`, pairwise (dest: [slots, *block_shape],
        on the pool's device)."""
        self._copy_out(self.kv, blocks, dest, slots)

    def copy_blocks_in(self, slots: list[int], src: torch.Tensor, blocks: list[int]) -> None:
        """The K/V of pool block `block` = src[slot], pairwise."""
        self._copy_in(self.kv, slots, src, blocks)

    def copy_pages_out(self, pages: list[int], dest: torch.Tensor, slots: list[int]) -> None:
        """dest[slot] = the window layers' K/V of window page `page`, pairwise (hybrid KV)."""
        self._copy_out(self.window_kv, pages, dest, slots)

    def copy_pages_in(self, slots: list[int], src: torch.Tensor, pages: list[int]) -> None:
        """The window layers' K/V of window page `page` = src[slot], pairwise (hybrid KV)."""
        self._copy_in(self.window_kv, slots, src, pages)

    def copy_slots(self, src: list[int], dst: list[int], window: bool = False) -> None:
        """Every layer's K/V of flat slot src[i] (block * block_size + offset) into dst[i], all
        read before any is written (a draft tree's accepted path moving to its depths); the
        window layers' pages with `window` (slots then name window pages)."""
        kv = self.window_kv if window else self.kv
        if kv.numel() == 0:  # a hybrid pool of window layers only
            return
        if self.pages is None:
            flat = kv.view(kv.shape[0], 2, -1, *kv.shape[4:])
            flat[:, :, dst] = flat[:, :, src]
            return
        p, bs = self.pages, self.block_size
        token, scale = p.num_kv_heads * p.head_dim, 4 * p.num_kv_heads  # a token's code and scale bytes
        rows = [(s // bs, s % bs, t // bs, t % bs) for s, t in zip(src, dst)]
        saved = [(kv[:, :, b, o * token:(o + 1) * token].clone(),
                  kv[:, :, b, p.code_bytes + o * scale:p.code_bytes + (o + 1) * scale].clone())
                 for b, o, _, _ in rows]
        for (_, _, b, o), (codes, scales) in zip(rows, saved):
            kv[:, :, b, o * token:(o + 1) * token] = codes
            kv[:, :, b, p.code_bytes + o * scale:p.code_bytes + (o + 1) * scale] = scales

    def _copy_out(self, kv: torch.Tensor, ids: list[int], dest: torch.Tensor, slots: list[int]) -> None:
        if self._numpy_copies:  # numpy copies in this thread: torch's intra-op
            pool, out = kv.numpy(), dest.numpy()  # threads cost 10x more on a busy machine
            for b, s in zip(ids, slots):
                out[s] = pool[:, :, b]
            return
        for b, s in zip(ids, slots):
            dest[s].copy_(kv[:, :, b], non_blocking=True)

    def _copy_in(self, kv: torch.Tensor, slots: list[int], src: torch.Tensor, ids: list[int]) -> None:
        if self._numpy_copies:
            pool, tier = kv.numpy(), src.numpy()
            for s, b in zip(slots, ids):
                pool[:, :, b] = tier[s]
            return
        for s, b in zip(slots, ids):
            kv[:, :, b].copy_(src[s], non_blocking=True)

    @staticmethod
    def geometry(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 kv_cache_dtype: str = "auto") -> tuple[tuple[int, ...], torch.dtype]:
        """One block's shape over all layers, and the pool's storage dtype."""
        code = page_code(kv_cache_dtype)
        if code:
            return (num_layers, 2, QuantizedPages(block_size, num_kv_heads, head_dim, code).page_bytes), torch.uint8
        return (num_layers, 2, block_size, num_kv_heads, head_dim), dtype

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> int:
        """A block's real bytes over all layers (codes and scales, for quantized pages)."""
        shape, storage = KVPool.geometry(num_layers, block_size, num_kv_heads, head_dim, dtype, kv_cache_dtype)
        return math.prod(shape) * torch.empty((), dtype=storage).element_size()


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           prefault: bool = False) -> tuple[torch.Tensor, object]:
    """Zero-filled pool, and the memory object that must outlive it. Never-written slots must
    hold finite values (attention multiplies masked-out V rows by zero weights, and
    0 * NaN is NaN). On CPU the pool is an anonymous mapping, so the OS commits zero pages
    on first touch instead of writing gigabytes up front (first writes measured 2-4x
    faster than into numpy's calloc-backed zeros), with 2 MiB pages asked for where the
    kernel grants them; `prefault` commits every page at once instead (MAP_POPULATE: the
    kernel zeroes them, ~0.6 ms a MiB here), so the process holds the pool from the start."""
    if device.type != "cpu" or math.prod(shape) == 0:  # empty: a hybrid pool of window layers only
        return torch.zeros(shape, dtype=dtype, device=device), None
    element = torch.empty((), dtype=dtype).element_size()
    size = math.prod(shape) * element
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
    memory = mmap.mmap(-1, max(size, 1), flags=flags)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8, count=size).view(dtype).view(shape), memory
