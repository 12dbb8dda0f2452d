"""Attention sinks (gpt-oss: each query head's logit joins its softmax's denominator with no
value row) in every attention backend and kernel: the torch backend (the reference) against
a dense masked softmax in float64, and the C kernels (decode, tiled prompt chunks; float32
pools and int8 pages) and Triton's (in its interpreter on CPU; few cases, it is slow) against
it too, on steps that mix decodes, whole prompts and extends over a cached prefix, with and
without a sliding window. Sinks of None leave every path as it was (the same bits)."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.kernels.triton import configure_triton  # imports no triton

configure_triton(torch.device("cpu"))  # before triton's first import

from radixserve.attention.cpu_backend import CpuAttentionBackend  # noqa: E402
from radixserve.attention.metadata import AttentionMetadata  # noqa: E402
from radixserve.attention.torch_backend import TorchAttentionBackend, store_kv  # noqa: E402
from radixserve.kernels.native_attention import load_native_attention  # noqa: E402
from radixserve.kernels.quantized_pages import QuantizedPages, dequantize, quantize  # noqa: E402

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover
    triton = None

needs_native = pytest.mark.skipif(load_native_attention() is None, reason="no C compiler here")
needs_triton = pytest.mark.skipif(triton is None, reason="no triton")

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 4
MIXED = [(9, 1), (1, 1), (23, 1), (14, 6), (11, 11), (30, 13)]  # (context after the step, new tokens)


class Step:
    """One step's q, new K/V, a pool holding every earlier token, its metadata, and the
    float64 dense answer with `sinks`."""

    def __init__(self, requests, window, sinks, int8=False, seed=0):
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        num_blocks = sum(-(-n // BLOCK) for n, _ in requests) + 2
        free = list(range(num_blocks))
        rng.shuffle(free)
        self.pages = QuantizedPages(BLOCK, KV_HEADS, HEAD_DIM) if int8 else None
        self.pool = (torch.zeros(2, num_blocks, self.pages.page_bytes, dtype=torch.uint8) if int8
                     else torch.zeros(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM))
        tables, starts, slots, new_k, new_v, contexts = [], [0], [], [], [], []
        for context, new in requests:
            table = [free.pop() for _ in range(-(-context // BLOCK))]
            keys = torch.randn(context, KV_HEADS, HEAD_DIM, generator=gen)
            values = torch.randn(context, KV_HEADS, HEAD_DIM, generator=gen)
            ctx_slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)])
            old = context - new
            store_kv(keys[:old], values[:old], self.pool[0], self.pool[1], ctx_slots[:old], self.pages)
            new_k.append(keys[old:]), new_v.append(values[old:]), slots.append(ctx_slots[old:])
            starts.append(starts[-1] + new)
            tables.append(table)
            if int8:
                keys, values = (dequantize(*quantize(x)) for x in (keys, values))
            contexts.append((keys, values))
        self.k, self.v = torch.cat(new_k), torch.cat(new_v)
        self.q = torch.randn(starts[-1], HEADS, HEAD_DIM, generator=gen)
        self.window, self.sinks, self.scale = window, sinks, HEAD_DIM**-0.5
        width = max(len(t) for t in tables)
        seq_lens = [c for c, _ in requests]
        self.meta = AttentionMetadata(
            num_decodes=sum(1 for _, n in requests if n == 1), block_size=BLOCK,
            query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            slot_mapping=torch.cat(slots), query_start_loc_list=starts, seq_lens_list=seq_lens,
        )
        self.want = self._dense(requests, starts, contexts)

    def _dense(self, requests, starts, contexts):
        out = torch.empty_like(self.q)
        group = HEADS // KV_HEADS
        for (context, new), start, (keys, values) in zip(requests, starts, contexts):
            keys, values = (x.double().repeat_interleave(group, 1) for x in (keys, values))
            rows = torch.arange(context - new, context)[:, None]
            j = torch.arange(context)[None, :]
            visible = (j <= rows) & ((j > rows - self.window) if self.window else True)
            scores = torch.einsum("rhd,thd->hrt", self.q[start : start + new].double(), keys) * self.scale
            scores = scores.masked_fill(~visible, float("-inf"))
            if self.sinks is not None:
                column = self.sinks.double().view(-1, 1, 1).expand(-1, new, 1)
                weights = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
            else:
                weights = scores.softmax(-1)
            out[start : start + new] = torch.einsum("hrt,thd->rhd", weights, values).float()
        return out

    def run(self, backend, sinks="step"):
        pool = self.pool.clone()
        sinks = self.sinks if sinks == "step" else sinks
        return backend.forward(self.q, self.k, self.v, pool[0], pool[1], backend.prepare(self.meta), self.window,
                               sinks=sinks)


def _sinks(seed=1):
    # some heads' sinks far above their scores (most weight on the sink), some far below (none)
    return torch.tensor([2.5, -1.0, 40.0, -30.0]) + torch.randn(HEADS, generator=torch.Generator().manual_seed(seed))


def _triton_backend(*args, **kwargs):
    from radixserve.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(*args, **kwargs)


BACKENDS = {
    "torch": (TorchAttentionBackend, {}, False),
    "cpu": pytest.param((CpuAttentionBackend, {}, False), marks=needs_native),
    "cpu_sdpa_chunks": pytest.param((CpuAttentionBackend, {"tiled_prefill": False}, False), marks=needs_native),
    "cpu_int8": pytest.param((CpuAttentionBackend, {}, True), marks=needs_native),
    "torch_int8": (TorchAttentionBackend, {}, True),
}


@pytest.mark.parametrize("window", [0, 5], ids=["full", "window5"])
@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
def test_sinks_in_every_cpu_backend_match_a_dense_softmax(backend, window):
    cls, options, int8 = backend
    step = Step(MIXED, window, _sinks(), int8=int8)
    impl = cls(HEADS, KV_HEADS, HEAD_DIM, step.scale, pages=step.pages, **options)
    out = step.run(impl)
    torch.testing.assert_close(out, step.want, atol=2e-5, rtol=1e-4)
    without = step.run(impl, sinks=None)
    assert not torch.allclose(without, out, atol=1e-3)  # the sinks changed the output


@needs_native
def test_without_sinks_the_c_kernels_give_the_same_bits():
    """sinks=None is the path as it was: the cpu backend's output equals a run that never names sinks."""
    step = Step(MIXED, 0, None)
    impl = CpuAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, step.scale)
    pool = step.pool.clone()
    plain = impl.forward(step.q, step.k, step.v, pool[0], pool[1], impl.prepare(step.meta))
    assert torch.equal(step.run(impl), plain)
    torch.testing.assert_close(plain, step.want, atol=2e-5, rtol=1e-4)


@needs_native
def test_sinks_of_the_wrong_shape_are_refused():
    step = Step(MIXED[:2], 0, None)
    with pytest.raises(ValueError, match="sinks"):
        step.run(CpuAttentionBackend(HEADS, KV_HEADS, HEAD_DIM, step.scale), sinks=torch.zeros(HEADS - 1))


@needs_triton
@pytest.mark.parametrize("window", [0, 5], ids=["full", "window5"])
def test_sinks_in_the_triton_kernels(window):
    step = Step(MIXED, window, _sinks())
    out = step.run(_triton_backend(HEADS, KV_HEADS, HEAD_DIM, step.scale))
    torch.testing.assert_close(out, step.want, atol=2e-5, rtol=1e-4)


@needs_triton
def test_sinks_join_the_merge_of_decode_splits():
    from radixserve.kernels.triton.decode_attention import decode_attention, decode_attention_reference

    step = Step([(40, 1), (9, 1)], 0, _sinks(2))
    pool = step.pool.clone()
    store_kv(step.k, step.v, pool[0], pool[1], step.meta.slot_mapping)
    args = (step.q, pool[0], pool[1], step.meta.block_tables, step.meta.seq_lens, step.scale)
    split = decode_attention(*args, num_splits=3, sinks=step.sinks)
    torch.testing.assert_close(split, step.want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(decode_attention_reference(*args, sinks=step.sinks), step.want, atol=2e-5, rtol=1e-4)
