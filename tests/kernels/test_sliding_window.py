"""Sliding-window attention (a layer's `window` W > 0: the query at context position p sees
keys p - W < j <= p) in every attention backend, float32 caches and int8 pages: the torch
backend (the reference) against a dense masked softmax in float64, and every other backend
and kernel against both.

Each step is built twice: once with a full block table, once with the entries of blocks
that lie wholly before every query's window replaced by an id outside the pool (as a hybrid
KV layout leaves them once those pages are freed). A backend must give exactly the same
output from both (it reads no such entry), and the right one.

On CPU the Triton kernels run in Triton's interpreter.
"""

from __future__ import annotations

import os
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

native = load_native_attention()
needs_native = pytest.mark.skipif(native is None, reason="no C compiler here")
needs_triton = pytest.mark.skipif(triton is None, reason="no triton")
PLACEHOLDER = 7  # entries before the window: num_blocks + PLACEHOLDER, outside the pool


def _triton_backend(*args, **kwargs):
    from radixserve.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(*args, **kwargs)


class Step:
    """One step of `requests` (context after the step, new tokens), decodes first, for a
    layer of sliding window `window`: its metadata with full tables (full) and with
    placeholders before the windows (windowed), q, the new k and v, a pool that already
    holds every earlier token, and the float64 dense answer."""

    def __init__(self, requests, window, *, heads, kv_heads, head_dim, block_size, int8=False, seed=0):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        requests = sorted(requests, key=lambda r: r[1] != 1)
        num_blocks = sum(-(-n // block_size) for n, _ in requests) + 3
        free = list(range(num_blocks))
        rng.shuffle(free)
        self.pages = QuantizedPages(block_size, kv_heads, head_dim) if int8 else None
        if int8:
            self.pool = torch.zeros(2, num_blocks, self.pages.page_bytes, dtype=torch.uint8)
        else:
            self.pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
        tables, windowed, starts, slots, new_k, new_v, contexts = [], [], [0], [], [], [], []
        for context, new in requests:
            table = [free.pop() for _ in range(-(-context // block_size))]
            first_query = context - new
            first_block = max(0, first_query - window + 1) // block_size if window else 0
            tables.append(table)
            windowed.append([num_blocks + PLACEHOLDER] * first_block + table[first_block:])
            keys = torch.randn(context, kv_heads, head_dim, generator=gen)
            values = torch.randn(context, kv_heads, head_dim, generator=gen)
            ctx_slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(context)])
            old = slice(first_block * block_size, first_query)  # what earlier steps left in the window's blocks
            store_kv(keys[old], values[old], self.pool[0], self.pool[1], ctx_slots[old], self.pages)
            new_k.append(keys[first_query:])
            new_v.append(values[first_query:])
            slots.append(ctx_slots[first_query:])
            starts.append(starts[-1] + new)
            if int8:
                keys, values = (dequantize(*quantize(x)) for x in (keys, values))
            contexts.append((keys, values))
        self.k, self.v = torch.cat(new_k), torch.cat(new_v)
        self.q = torch.randn(starts[-1], heads, head_dim, generator=gen)
        self.window, self.scale = window, head_dim**-0.5
        self.full = self._meta(requests, tables, starts, torch.cat(slots), block_size)
        self.windowed = self._meta(requests, windowed, starts, torch.cat(slots), block_size)
        self.want = self._dense(requests, starts, contexts)

    @staticmethod
    def _meta(requests, tables, starts, slots, block_size):
        width = max(len(t) for t in tables)
        seq_lens = [context for context, _ in requests]
        return AttentionMetadata(
            num_decodes=sum(1 for _, new in requests if new == 1), block_size=block_size,
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            slot_mapping=slots, query_start_loc_list=starts, seq_lens_list=seq_lens,
        )

    def _dense(self, requests, starts, contexts):
        """Every query row against the keys of its window, by a masked softmax in float64."""
        out = torch.empty_like(self.q)
        group = self.q.shape[1] // self.k.shape[1]
        for (context, new), start, (keys, values) in zip(requests, starts, contexts):
            keys = keys.double().repeat_interleave(group, 1)
            values = values.double().repeat_interleave(group, 1)
            positions = torch.arange(context - new, context)[:, None]
            j = torch.arange(context)[None, :]
            visible = (j <= positions) & ((j > positions - self.window) if self.window else True)
            scores = torch.einsum("rhd,thd->hrt", self.q[start : start + new].double(), keys) * self.scale
            weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[start : start + new] = torch.einsum("hrt,thd->rhd", weights, values).float()
        return out

    def run(self, backend_class, meta, window=None, **options):
        """The backend's output for this step's layer, on a copy of the pool (returned too)."""
        heads, head_dim = self.q.shape[1], self.q.shape[2]
        backend = backend_class(heads, self.k.shape[1], head_dim, self.scale, pages=self.pages, **options)
        pool = self.pool.clone()
        out = backend.forward(self.q, self.k, self.v, pool[0], pool[1], backend.prepare(meta),
                              self.window if window is None else window)
        return out, pool


STEPS = {
    "decodes": [(1, 1), (5, 1), (17, 1), (40, 1), (64, 1), (23, 1)],
    "chunks": [(40, 7), (23, 23), (50, 12), (9, 9)],  # extends over a cached prefix, whole prompts
    "mixed": [(33, 1), (3, 1), (61, 1), (45, 11), (12, 12), (70, 30)],
}
WINDOWS = {"1": 1, "under_block": 3, "block": 8, "blocks": 21, "past_context": 1000}
GEOMETRIES = {"mha": (2, 2, 16), "gqa": (6, 2, 32), "gqa_d256": (4, 1, 256)}


def _backends(steps=None, block_sizes=(8,)):
    """Each backend (with each kind of step and block size, where `steps`); Triton's
    interpreter is slow, so it takes the mixed steps (decodes and chunks of every kind) in
    blocks of 8 only."""
    backends = [
        (TorchAttentionBackend, {}, "torch", ()),
        (CpuAttentionBackend, {}, "cpu", needs_native),
        (CpuAttentionBackend, {"tiled_prefill": False}, "cpu_sdpa", needs_native),
        (_triton_backend, {}, "triton", needs_triton),
    ]
    if steps is None:
        return [pytest.param(cls, options, id=name, marks=marks) for cls, options, name, marks in backends]
    return [pytest.param(cls, options, kind, block_size, id=f"{name}-{kind}-{block_size}", marks=marks)
            for cls, options, name, marks in backends for kind in steps for block_size in block_sizes
            if name != "triton" or (kind, block_size) == ("mixed", 8)]


def _tolerance(int8):
    return dict(atol=2e-5, rtol=2e-5) if not int8 else dict(atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("steps", STEPS)
def test_torch_reference_matches_dense_masked_softmax(steps, window, geometry, int8):
    heads, kv_heads, head_dim = GEOMETRIES[geometry]
    step = Step(STEPS[steps], WINDOWS[window], heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=8,
                int8=int8, seed=len(steps) + WINDOWS[window])
    out, pool = step.run(TorchAttentionBackend, step.windowed)
    torch.testing.assert_close(out, step.want, **_tolerance(int8))
    full, full_pool = step.run(TorchAttentionBackend, step.full)
    assert torch.equal(out, full) and torch.equal(pool, full_pool)


def _backend_cases():
    """Every backend, kind of step and block size against every window, geometry and KV dtype;
    Triton's interpreter (about 3 s a case) takes every window on the GQA geometry (groups of 3
    over 2 KV heads: the head indexing that mha's and one KV head's would not show) and the
    other geometries on the window spanning blocks, in both dtypes where the window reaches
    back past a block boundary (block, blocks): int8 pages change how a block's keys are read,
    not which blocks or rows the window keeps, and the windows within a block or past the
    context take the float32 path through the same masking."""
    cases = []
    for backend in _backends(STEPS, (8, 5)):
        for window in WINDOWS:
            for geometry in GEOMETRIES:
                if "triton" in backend.id and geometry != "gqa" and window != "blocks":
                    continue
                for int8, dtype in ((False, "float32"), (True, "int8")):
                    if int8 and "triton" in backend.id and window not in ("block", "blocks"):
                        continue
                    cases.append(pytest.param(*backend.values, window, geometry, int8, marks=backend.marks,
                                              id=f"{window}-{geometry}-{dtype}-{backend.id}"))
    return cases


@pytest.mark.parametrize("backend_class, options, steps, block_size, window, geometry, int8", _backend_cases())
def test_backend_matches_reference_and_reads_nothing_before_the_window(backend_class, options, steps, block_size,
                                                                       window, geometry, int8):
    heads, kv_heads, head_dim = GEOMETRIES[geometry]
    step = Step(STEPS[steps], WINDOWS[window], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                block_size=block_size, int8=int8, seed=block_size + WINDOWS[window])
    out, pool = step.run(backend_class, step.windowed, **options)
    reference, reference_pool = step.run(TorchAttentionBackend, step.windowed)
    assert torch.equal(pool, reference_pool), "the step's K/V went exactly into its slots"
    torch.testing.assert_close(out, reference, **_tolerance(int8))
    torch.testing.assert_close(out, step.want, **_tolerance(int8))
    full, _ = step.run(backend_class, step.full, **options)
    assert torch.equal(out, full), "the entries before the window changed the output"


@pytest.mark.parametrize("backend_class, options", _backends())
def test_one_plan_serves_full_and_window_layers(backend_class, options):
    """Layers of a step alternate windows on one plan; window 0 is full causal attention, as
    before, and a window past every context is the same attention."""
    heads, kv_heads, head_dim = GEOMETRIES["gqa"]
    steps = {w: Step(STEPS["mixed"], w, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=8, seed=3)
             for w in (0, 5, 16)}
    plain = steps[0]
    backend = backend_class(heads, kv_heads, head_dim, plain.scale, **options)
    plan = backend.prepare(plain.full)
    outputs = {}
    for window in (0, 5, 16, 0, 5, 1000):
        pool = plain.pool.clone()
        outputs.setdefault(window, []).append(
            backend.forward(plain.q, plain.k, plain.v, pool[0], pool[1], plan, window))
    for window in (5, 16):
        torch.testing.assert_close(outputs[window][0], steps[window].want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(outputs[0][0], plain.want, atol=2e-5, rtol=2e-5)
    assert torch.equal(outputs[0][0], outputs[0][1]) and torch.equal(outputs[5][0], outputs[5][1])
    before = backend_class(heads, kv_heads, head_dim, plain.scale, **options)
    pool = plain.pool.clone()
    assert torch.equal(before.forward(plain.q, plain.k, plain.v, pool[0], pool[1], before.prepare(plain.full)),
                       outputs[0][0]), "window 0 is the default"
    torch.testing.assert_close(outputs[1000][0], outputs[0][0], atol=1e-6, rtol=1e-6)


# ---- the C kernels themselves, at every vector width --------------------------------------

LONG_STEPS = {
    # prompt chunks past one work item of query rows and many tiles of keys
    "long_chunks": [(700, 500), (301, 300), (260, 37)],
    "decodes": [(1, 1), (37, 1), (300, 1), (129, 1), (64, 1)],
}


def _kernels_built(tmp_path, flags):
    import ctypes
    import shutil

    from radixserve.kernels import native_build
    from radixserve.kernels.native_attention import NativePagedAttention

    if not flags:
        return native
    compiler = shutil.which("cc") or shutil.which("gcc")
    fns = {}
    for source, names in (("paged_attention.c", ("paged_decode_attention_f32", "paged_store_f32",
                                                 "paged_decode_attention_i8", "paged_store_i8")),
                          ("prefill_attention.c", ("paged_prefill_attention_f32", "paged_prefill_attention_i8",
                                                   "paged_prefill_bf16_available"))):
        library = tmp_path / source.replace(".c", ".so")
        native_build._compile(compiler, native_build.CSRC / source, ["-fopenmp", *flags], library)
        built = ctypes.CDLL(str(library))
        for name in names:
            fn = getattr(built, name)
            fn.argtypes, fn.restype = list(native_build.SIGNATURES[name].argtypes), native_build.SIGNATURES[name].restype
            fns[name] = fn
    return NativePagedAttention(*fns.values())


def _kernel_step(kernels, step: Step, meta, bf16=False):
    """The step through the kernels alone: store, decode rows, tiled chunks."""
    pool = step.pool.clone()
    store_kv(step.k, step.v, pool[0], pool[1], meta.slot_mapping, step.pages)
    d = meta.num_decodes
    out = torch.full_like(step.q, 7.0)
    if d:
        out[:d] = kernels.decode(step.q[:d].contiguous(), pool[0], pool[1], meta.block_tables[:d],
                                 meta.seq_lens[:d], step.scale, step.pages, step.window)
    if d < meta.num_requests:
        kernels.prefill(step.q, pool[0], pool[1], meta.block_tables[d:], meta.query_start_loc[d:],
                        meta.seq_lens[d:], step.scale, out, step.pages, bf16, step.window)
    return out


@needs_native
@pytest.mark.parametrize("flags", [[], ["-mno-avx512f"], ["-mno-avx512f", "-mno-avx2", "-mno-fma"]],
                         ids=["native", "avx2", "scalar"])
def test_native_kernels_take_windows_at_every_vector_width(tmp_path, flags):
    kernels = _kernels_built(tmp_path, flags)
    for steps in ("long_chunks", "decodes", "mixed"):
        requests = LONG_STEPS.get(steps) or STEPS[steps]
        # (16, 2, 64): 8 query heads a KV head, more than int8's AVX-512 path folds at once (its tile path)
        for (heads, kv_heads, head_dim), block_size, window in [((9, 3, 64), 5, 37), ((8, 2, 40), 16, 100),
                                                                ((4, 1, 256), 16, 16), ((2, 2, 16), 3, 2),
                                                                ((16, 2, 64), 16, 21)]:
            for int8 in (False, True):
                step = Step(requests, window, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            block_size=block_size, int8=int8, seed=window)
                out = _kernel_step(kernels, step, step.windowed)
                torch.testing.assert_close(out, step.want, **_tolerance(int8))
                assert torch.equal(out, _kernel_step(kernels, step, step.full))


@needs_native
@pytest.mark.parametrize("options", [{}, {"tiled_prefill": False}], ids=["tiled", "sdpa"])
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("window", [0, 21])
def test_cpu_backend_takes_views_of_the_fused_qkv_rows(window, int8, options):
    """q, k and v as views of one fused row (the model passes them so to a backend that takes
    strided rows), row-major or column-major: the same output and pool, bit for bit, as from
    contiguous copies."""
    step = Step(STEPS["mixed"], window, heads=4, kv_heads=2, head_dim=32, block_size=8, int8=int8, seed=9)
    backend = CpuAttentionBackend(4, 2, 32, step.scale, pages=step.pages, **options)
    assert backend.takes_strided_rows and not TorchAttentionBackend(4, 2, 32, step.scale).takes_strided_rows
    fused = torch.cat([t.flatten(1) for t in (step.q, step.k, step.v)], 1)
    views = fused[:, :128].view(-1, 4, 32), fused[:, 128:192].view(-1, 2, 32), fused[:, 192:].view(-1, 2, 32)
    column_major = fused.t().contiguous().t()  # as torch.mm(weight, x.t()).t() returns a product
    transposed = (column_major[:, :128].unflatten(1, (4, 32)), column_major[:, 128:192].unflatten(1, (2, 32)),
                  column_major[:, 192:].unflatten(1, (2, 32)))
    outputs = []
    for q, k, v in ((step.q, step.k, step.v), views, transposed):
        pool = step.pool.clone()
        outputs.append((backend.forward(q, k, v, pool[0], pool[1], backend.prepare(step.windowed), window), pool))
    for out, pool in outputs[1:]:
        assert torch.equal(out, outputs[0][0]) and torch.equal(pool, outputs[0][1])
    torch.testing.assert_close(outputs[1][0], step.want, **_tolerance(int8))


@needs_native
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("window", [57, 64, 70, 100, 131])
def test_native_prefill_row_groups_read_only_their_keys(window, int8):
    """Extends over prefixes several windows long, Gemma 3's heads (4 query heads on one KV head
    of 256): each row group reads its tile from the first vector of keys any of its rows sees to
    the last, so windows start at every offset inside a tile's vectors and rows see whole tiles
    past a group's first vector."""
    requests = [(700, 144), (451, 96), (390, 200), (260, 37)]
    step = Step(requests, window, heads=4, kv_heads=1, head_dim=256, block_size=16, int8=int8, seed=window)
    out = _kernel_step(native, step, step.windowed)
    torch.testing.assert_close(out, step.want, **_tolerance(int8))
    assert torch.equal(out, _kernel_step(native, step, step.full))


@needs_native
@pytest.mark.skipif(native is None or not native.has_bf16_prefill(64), reason="no AVX512_BF16 here")
def test_native_prefill_with_bf16_dots_takes_windows():
    for window in (1, 37, 200):
        step = Step(LONG_STEPS["long_chunks"], window, heads=9, kv_heads=3, head_dim=64, block_size=5, seed=window)
        out = _kernel_step(native, step, step.windowed, bf16=True)
        torch.testing.assert_close(out, step.want, atol=3e-2, rtol=3e-2)
        assert torch.equal(out, _kernel_step(native, step, step.full, bf16=True))


@needs_native
def test_native_kernels_check_only_the_table_from_the_window_on():
    """An out-of-pool id inside the window is still refused, before anything is written."""
    step = Step(STEPS["mixed"], 8, heads=4, kv_heads=2, head_dim=16, block_size=4, seed=1)
    meta = step.windowed
    for rows, column in (("decode", lambda t, n: (n - 1) // 4), ("chunk", lambda t, n: (n - 1) // 4)):
        tables = meta.block_tables.clone()
        r = 0 if rows == "decode" else meta.num_decodes
        tables[r, column(tables, meta.seq_lens_list[r])] = step.pool.shape[1]
        bad = AttentionMetadata(meta.num_decodes, meta.block_size, meta.query_start_loc, meta.seq_lens, tables,
                                meta.slot_mapping, meta.query_start_loc_list, meta.seq_lens_list)
        with pytest.raises(ValueError, match="outside the pool"):
            _kernel_step(native, step, bad)


# ---- the native decoder: each layer's window ----------------------------------------------


def _layer_windows(engine, windows):
    """Layer i of every step attends with windows[i] (the backend's forward sees the layers in order)."""
    backend = engine.runner.backend
    forward, calls = backend.forward, [0]

    def windowed(q, k, v, k_cache, v_cache, plan, window=0, sinks=None):
        window = windows[calls[0] % len(windows)]
        calls[0] += 1
        return forward(q, k, v, k_cache, v_cache, plan, window, sinks=sinks)

    backend.forward = windowed


@needs_native
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_native_decoder_gives_each_layer_its_window_bit_for_bit(tiny_model_dir, kv_cache_dtype):
    from radixserve import Engine, SamplingParams
    from radixserve.kernels.native_ops import max_rows
    from radixserve.model.native_decoder import NativeDecoder

    if max_rows() == 0:
        pytest.skip("no skinny matmul kernel for this CPU")
    engines = [Engine(str(tiny_model_dir("llama")), block_size=4, kv_cache_dtype=kv_cache_dtype) for _ in range(2)]
    fused, layers = engines
    spec = fused.runner.spec
    windows = [(5, 0, 9)[i % 3] for i in range(spec.num_layers)]
    fused.runner.model.native = NativeDecoder.for_model(spec, fused.runner.model.layers, windows)
    assert fused.runner.model.native is not None
    fused.runner.row_limit = max_rows()
    layers.runner.model.native = None
    decoder, native_steps = fused.runner.model.native, []
    run = decoder.run
    decoder.run = lambda *args, **kwargs: native_steps.append(run(*args, **kwargs)) or native_steps[-1]
    runs = []
    for engine in engines:
        _layer_windows(engine, windows)
        logits = []
        engine.runner.model.register_forward_hook(lambda module, args, out: logits.append(out.clone()))
        prompts = [[5, 9, 2, 7], [3 + i % 90 for i in range(30)], [11] * 19]
        outputs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        runs.append((logits, [o.token_ids for o in outputs]))
    (fused_logits, fused_tokens), (layer_logits, layer_tokens) = runs
    assert fused_tokens == layer_tokens
    assert len(fused_logits) == len(layer_logits)
    assert all(torch.equal(a, b) for a, b in zip(fused_logits, layer_logits))
    assert sum(out is not None for out in native_steps) >= 15, "the decode steps ran natively"
    with pytest.raises(ValueError, match="windows for"):
        NativeDecoder.for_model(spec, fused.runner.model.layers, windows[:-1])


# ---- the Triton kernels themselves: split-K decode, and their torch references ---------------


@needs_triton
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_kernels_and_their_references_take_windows(num_splits, int8):
    from radixserve.kernels.triton.decode_attention import decode_attention, decode_attention_reference
    from radixserve.kernels.triton.extend_attention import extend_attention, extend_attention_reference

    for window, block_size in ((3, 4), (21, 5), (70, 8)):
        step = Step(STEPS["mixed"], window, heads=4, kv_heads=2, head_dim=32, block_size=block_size, int8=int8,
                    seed=window)
        meta, pool, d = step.windowed, step.pool.clone(), step.windowed.num_decodes
        store_kv(step.k, step.v, pool[0], pool[1], meta.slot_mapping, step.pages)
        caches, scales = (pool[0], pool[1]), {}
        if int8:
            caches = (step.pages.codes(pool[0]), step.pages.codes(pool[1]))
            scales = dict(k_scales=step.pages.scales(pool[0]), v_scales=step.pages.scales(pool[1]))
        decode_args = (step.q[:d], *caches, meta.block_tables[:d], meta.seq_lens[:d], step.scale)
        extend_args = (step.q, *caches, meta.block_tables[d:], meta.query_start_loc[d:], meta.seq_lens[d:],
                       step.scale)
        tolerance = _tolerance(int8)
        for fn, reference, args, rows, extra in (
                (decode_attention, decode_attention_reference, decode_args, slice(0, d), dict(num_splits=num_splits)),
                (extend_attention, extend_attention_reference, extend_args, slice(d, None), {})):
            got = fn(*args, window=window, **scales, **extra)[rows]
            torch.testing.assert_close(got, step.want[rows], **tolerance)
            torch.testing.assert_close(reference(*args, window=window, **scales)[rows], step.want[rows], **tolerance)
