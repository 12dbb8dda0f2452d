"""Micro-benchmarks of the Triton attention kernels on one CUDA GPU, and an engine run;
with --cpu, the tiled C prefill kernel on CPU beside SDPA and the model's matmuls.

    python -m bench.bench_kernels            # decode and prefix-extend vs torch SDPA
    python -m bench.bench_kernels --engine   # default model, bf16: triton vs torch backend
    python -m bench.bench_kernels --cpu      # float32 on CPU: GFLOP/s of attention and matmuls
    python -m bench.bench_kernels --cpu --cpu-rows  # the decode kernel on several rows of a request
    python -m bench.bench_kernels --cpu --cpu-routing  # step times behind the runner's ROWS_ATTENTION_WORK
    python -m bench.bench_kernels --cpu --cpu-quantized  # quantized weights: ours, torch's weight-only ops, float32

Kernels are timed two ways: replayed from a CUDA graph (the GPU's own time, no host
launch overhead) and called eagerly (what an engine without CUDA graphs pays). The
baseline is torch's scaled_dot_product_attention on the same values copied into dense,
contiguous [batch, heads, tokens, head_dim] tensors (no block table to follow), so it
is an upper bound on what a paged kernel can reach. Bandwidth counts the bytes an ideal
kernel must move: every context K and V row once, plus q and the output.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.lib.cli import Figures, apply_quick, bench_parser

# (substring of the device name, peak HBM bandwidth in GB/s)
PEAK_BANDWIDTH_GBPS = [("H200", 4800.0), ("H100 80GB HBM3", 3350.0), ("H100 SXM", 3350.0), ("A100-SXM4-80GB", 2039.0),
                       ("A100 80GB PCIe", 1935.0)]


@dataclass(frozen=True)
class Heads:
    name: str
    num_heads: int
    kv_heads: int
    head_dim: int

    def __str__(self) -> str:
        return f"{self.name} ({self.num_heads}q/{self.kv_heads}kv heads, head_dim {self.head_dim})"


HEAD_CONFIGS = [Heads("SmolLM2-like", 9, 3, 64), Heads("Llama-8B-like", 32, 8, 128)]
BLOCK_SIZE = 16
DTYPE = torch.bfloat16


def peak_bandwidth(device_name: str) -> float | None:
    for key, peak in PEAK_BANDWIDTH_GBPS:
        if key in device_name:
            return peak
    return None


def bandwidth_text(num_bytes: float, ms: float, peak: float | None) -> str:
    gbps = num_bytes / ms / 1e6
    share = f" = {100 * gbps / peak:.0f}% of {peak:.0f}" if peak else ""
    return f"{gbps:7.0f} GB/s{share}"


def time_ms(fn) -> tuple[float, float]:
    """(CUDA-graph replay ms, eager median ms) of one call."""
    import triton.testing

    graph = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    eager = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return graph, eager


# ---- paged data --------------------------------------------------------------------------


@dataclass
class PagedBatch:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor

    def dense(self, cache: torch.Tensor) -> torch.Tensor:
        """[B, kv_heads, context, head_dim], contiguous, as SDPA wants it."""
        context = int(self.seq_lens[0])
        gathered = cache[self.block_tables.long()].flatten(1, 2)[:, :context]
        return gathered.transpose(1, 2).contiguous()


def paged_batch(batch: int, context: int, heads: Heads, device: torch.device) -> PagedBatch:
    """Every request `context` tokens long, its blocks scattered through a shuffled pool."""
    blocks_per_request = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_request
    shape = (num_blocks, BLOCK_SIZE, heads.kv_heads, heads.head_dim)
    k_cache = torch.randn(shape, dtype=DTYPE, device=device)
    v_cache = torch.randn(shape, dtype=DTYPE, device=device)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_request).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return PagedBatch(k_cache, v_cache, tables, seq_lens)


def sdpa(q, k, v, **kwargs) -> torch.Tensor:
    """SDPA with grouped-query heads, expanding K/V when this torch lacks enable_gqa."""
    try:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    except (TypeError, RuntimeError):
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), **kwargs)


# ---- decode ------------------------------------------------------------------------------


def bench_decode(heads: Heads, batch: int, context: int, device: torch.device, peak: float | None,
                 figures: Figures) -> None:
    from radixserve.kernels.triton.decode_attention import _block_n, _choose_num_splits, decode_attention

    data = paged_batch(batch, context, heads, device)
    q = torch.randn(batch, heads.num_heads, heads.head_dim, dtype=DTYPE, device=device)
    out = torch.empty_like(q)
    scale = heads.head_dim**-0.5
    splits = _choose_num_splits(q, heads.kv_heads, context, _block_n(q))
    element = q.element_size()
    num_bytes = 2 * batch * context * heads.kv_heads * heads.head_dim * element + 2 * q.numel() * element

    def run(num_splits):
        return lambda: decode_attention(q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens, scale,
                                        max_seq_len=context, num_splits=num_splits, out=out)

    k_dense, v_dense = data.dense(data.k_cache), data.dense(data.v_cache)
    q_dense = q.unsqueeze(2)
    expected = sdpa(q_dense, k_dense, v_dense, scale=scale).squeeze(2)
    run(None)()
    error = (out.float() - expected.float()).abs().max().item()

    print(f"\ndecode attention, {heads}, {DTYPE}, batch {batch} x context {context}, block size {BLOCK_SIZE}")
    print(f"  data: {num_bytes / 1e6:.0f} MB of K/V+q+out; max |triton - SDPA| = {error:.2e}")
    results = {}
    for label, fn in [
        (f"triton paged, auto split ({splits})", run(None)),
        ("triton paged, single pass", run(1)),
        ("torch SDPA, dense contiguous", lambda: sdpa(q_dense, k_dense, v_dense, scale=scale)),
    ]:
        graph, eager = time_ms(fn)
        results[label] = graph
        figures.add(f"decode, {heads.name}", label, graph, eager_ms=eager)
        print(f"  {label:36s} graph {graph * 1e3:8.1f} us {bandwidth_text(num_bytes, graph, peak)}"
              f" | eager {eager * 1e3:8.1f} us {bandwidth_text(num_bytes, eager, peak)}")
    auto, baseline = results[f"triton paged, auto split ({splits})"], results["torch SDPA, dense contiguous"]
    print(f"  ratio: triton auto is {baseline / auto:.2f}x the speed of SDPA (graph times)")
    del data, k_dense, v_dense


# ---- prefix extend -----------------------------------------------------------------------


def bench_extend(heads: Heads, batch: int, prefix: int, new: int, device: torch.device, peak: float | None,
                 figures: Figures) -> None:
    from torch.nn.attention.bias import causal_lower_right

    from radixserve.kernels.triton.extend_attention import extend_attention

    context = prefix + new
    data = paged_batch(batch, context, heads, device)
    q = torch.randn(batch * new, heads.num_heads, heads.head_dim, dtype=DTYPE, device=device)
    out = torch.empty_like(q)
    starts = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=device)
    scale = heads.head_dim**-0.5
    element = q.element_size()
    num_bytes = 2 * batch * context * heads.kv_heads * heads.head_dim * element + 2 * q.numel() * element
    flops = 4 * heads.head_dim * heads.num_heads * batch * (new * prefix + new * (new + 1) // 2)

    def run():
        return extend_attention(q, data.k_cache, data.v_cache, data.block_tables, starts, data.seq_lens, scale,
                                max_query_len=new, out=out)

    k_dense, v_dense = data.dense(data.k_cache), data.dense(data.v_cache)
    q_dense = q.view(batch, new, heads.num_heads, heads.head_dim).transpose(1, 2).contiguous()
    mask = causal_lower_right(new, context)

    def baseline():
        return sdpa(q_dense, k_dense, v_dense, attn_mask=mask, scale=scale)

    run()
    expected = baseline().transpose(1, 2).reshape_as(out)
    error = (out.float() - expected.float()).abs().max().item()

    print(f"\nprefix-extend attention, {heads}, {DTYPE}, batch {batch} x ({prefix} cached + {new} new) tokens,"
          f" block size {BLOCK_SIZE}")
    print(f"  data: {num_bytes / 1e6:.0f} MB of K/V+q+out, {flops / 1e9:.1f} GFLOP (causal); "
          f"max |triton - SDPA| = {error:.2e}")
    results = {}
    for label, fn in [("triton paged", run), ("torch SDPA, dense contiguous", baseline)]:
        graph, eager = time_ms(fn)
        results[label] = graph
        figures.add(f"extend, {heads.name}", label, graph, eager_ms=eager)
        print(f"  {label:36s} graph {graph * 1e3:8.1f} us {flops / graph / 1e9:6.1f} TFLOP/s "
              f"{bandwidth_text(num_bytes, graph, peak)} | eager {eager * 1e3:8.1f} us")
    print(f"  ratio: triton is {results['torch SDPA, dense contiguous'] / results['triton paged']:.2f}x "
          "the speed of SDPA (graph times)")
    del data, k_dense, v_dense


# ---- engine ------------------------------------------------------------------------------


def bench_engine(args: argparse.Namespace, figures: Figures) -> None:
    from radixserve import Engine, SamplingParams

    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 20000, (args.prompts, args.prompt_len), generator=generator).tolist()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    print(f"\nengine: default model, bfloat16, cuda; {args.prompts} prompts x {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens each (greedy, ignore_eos), prefix cache on (random prompts share nothing)")
    outputs, seconds = {}, {}
    for backend in ("triton", "torch"):
        engine = Engine(dtype="bfloat16", device="cuda", attention_backend=backend, kv_cache_memory=4 << 30)
        engine.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # compile
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        torch.cuda.synchronize()
        seconds[backend] = time.perf_counter() - start
        outputs[backend] = [o.token_ids for o in outs]
        produced = sum(len(t) for t in outputs[backend])
        total = produced + args.prompts * args.prompt_len
        figures.add("engine", backend, seconds[backend] * 1e3, output_tokens=produced, total_tokens=total)
        print(f"  {backend:6s} backend: {seconds[backend]:6.2f} s, {produced / seconds[backend]:8.0f} output tok/s, "
              f"{total / seconds[backend]:8.0f} total tok/s")
        del engine
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(outputs["triton"], outputs["torch"]))
    print(f"  ratio: triton backend is {seconds['torch'] / seconds['triton']:.2f}x the torch backend's throughput; "
          f"{same}/{args.prompts} greedy outputs identical (bf16 may legitimately diverge late)")


# ---- CPU: the tiled prefill kernel beside SDPA and the matmuls ------------------------------


def bench_cpu(args: argparse.Namespace, figures: Figures) -> None:
    """GFLOP/s of prompt-chunk attention at the default model's heads (float32, block size
    16, blocks shuffled through the pool): the tiled C kernel reading the pool in place, and
    torch's SDPA over the gathered pages (the cpu backend's path with tiled_prefill off), and
    where the CPU has AVX512_BF16 the tiled kernel with bf16 dot products (prefill_attention_dtype
    bfloat16); beside them the model's four matmuls at 512 rows on oneDNN, as a prefill chunk runs
    them, in float32 and, where oneDNN multiplies bf16 natively, on bf16 inputs and a bf16 copy of
    the weight (prefill_matmul_dtype bfloat16). Each case's calls take turns; the best of
    --cpu-repeats is reported, in CPU time on one thread (OMP_NUM_THREADS=1: what another
    program's load hardly moves), else wall time."""
    from radixserve.attention.torch_backend import PrefillChunk, prefill_attention
    from radixserve.kernels.native_attention import load_native_attention
    from radixserve.kernels.onednn_linear import bf16_available, onednn_linear, onednn_linear_bf16

    kernels = load_native_attention()
    heads = HEAD_CONFIGS[0]
    scale = heads.head_dim**-0.5
    clock = "CPU time" if torch.get_num_threads() == 1 else "wall time"
    bf16 = kernels.has_bf16_prefill(heads.head_dim)
    print(f"CPU, float32, {torch.get_num_threads()} threads, {clock}; attention: {heads}, block size {BLOCK_SIZE}; "
          f"bf16 dot products (AVX512_BF16): {'measured too' if bf16 else 'not on this CPU'}")
    for prefix, new in [(0, 512), (0, 2048), (0, 4096), (8192 - 256, 256)]:
        data = paged_batch(1, prefix + new, heads, torch.device("cpu"))
        data.k_cache, data.v_cache = data.k_cache.float(), data.v_cache.float()
        q = torch.randn(new, heads.num_heads, heads.head_dim)
        k, v = (torch.randn(new, heads.kv_heads, heads.head_dim) for _ in range(2))
        out = torch.empty_like(q)
        starts = torch.tensor([0, new], dtype=torch.int32)
        context = prefix + new
        mask = torch.arange(context)[None, :] <= torch.arange(new)[:, None] + prefix
        # as the engine plans them: a chunk with no cached prefix attends to its own fresh K/V
        chunk = PrefillChunk(0, new, data.block_tables[0].long(), context, mask) if prefix else \
            PrefillChunk(0, new, None, new, None)
        flops = 4 * heads.head_dim * heads.num_heads * (new * prefix + new * (new + 1) // 2)
        calls = {
            "tiled C kernel, paged in place": lambda: kernels.prefill(
                q, data.k_cache, data.v_cache, data.block_tables, starts, data.seq_lens, scale, out),
            "SDPA over gathered pages": lambda: prefill_attention(q, k, v, data.k_cache, data.v_cache, chunk, scale),
        }
        if bf16:
            calls["tiled, bf16 dot products"] = lambda: kernels.prefill(
                q, data.k_cache, data.v_cache, data.block_tables, starts, data.seq_lens, scale, out, None, True)
        results = _best_cpu_times(calls, args.cpu_repeats)
        label = f"{new} new over {prefix} cached" if prefix else f"{new}-token prompt"
        print(f"  attention, {label} ({flops / 1e9:.2f} GFLOP, causal):")
        for name, seconds in results.items():
            figures.add(f"attention, {label}", name, seconds * 1e3)
            print(f"    {name:32s} {seconds * 1e3:8.2f} ms {flops / seconds / 1e9:7.1f} GFLOP/s")
    rows, hidden, inter = 512, 576, 1536
    q_size, kv_size = heads.num_heads * heads.head_dim, heads.kv_heads * heads.head_dim
    x = {n: torch.randn(rows, n) for n in (hidden, q_size, inter)}
    matmuls = {f"qkv {hidden}->{q_size + 2 * kv_size}": (hidden, q_size + 2 * kv_size),
               f"o {q_size}->{hidden}": (q_size, hidden), f"gate_up {hidden}->{2 * inter}": (hidden, 2 * inter),
               f"down {inter}->{hidden}": (inter, hidden)}
    weights = {name: torch.randn(n_out, n_in) for name, (n_in, n_out) in matmuls.items()}
    first = next(iter(matmuls))
    onednn = onednn_linear(x[matmuls[first][0]], weights[first], None) is not None

    def matmul(name):
        inputs = x[matmuls[name][0]]
        return lambda: onednn_linear(inputs, weights[name], None) if onednn else F.linear(inputs, weights[name])

    def matmul_bf16(name):
        inputs, weight = x[matmuls[name][0]], weights[name].to(torch.bfloat16)
        return lambda: onednn_linear_bf16(inputs, weight, None)

    calls = {name: matmul(name) for name in matmuls}
    if onednn and bf16_available():
        calls.update({f"{name}, bf16": matmul_bf16(name) for name in matmuls})
    results = _best_cpu_times(calls, args.cpu_repeats)
    print(f"  the model's matmuls, {rows} rows, on {'oneDNN' if onednn else 'F.linear (no oneDNN here)'}"
          f"{' (float32, then bf16 inputs)' if len(calls) > len(matmuls) else ''}:")
    for name, seconds in results.items():
        n_in, n_out = matmuls[name.removesuffix(", bf16")]
        flops = 2 * rows * n_in * n_out
        figures.add(f"matmul {name.removesuffix(', bf16')}", "bf16" if name.endswith(", bf16") else "float32",
                    seconds * 1e3)
        print(f"    {name:32s} {seconds * 1e3:8.2f} ms {flops / seconds / 1e9:7.1f} GFLOP/s")


def bench_cpu_decode_rows(args: argparse.Namespace, figures: Figures) -> None:
    """The C decode kernel on several query rows of one request (a speculative verify, a small
    prompt chunk: row i sees the context up to its own position), float32 and int8 pages, at
    the default model's heads: the rows in one call, which reads each K/V tile once for all of
    them, beside the same rows one call each (each walks the context again) and beside rows of
    as many different requests (no context to share, what every row costs alone)."""
    from radixserve.kernels.quantized_pages import QuantizedPages
    from radixserve.kernels.native_attention import load_native_attention

    kernels = load_native_attention()
    heads = HEAD_CONFIGS[0]
    scale = heads.head_dim**-0.5
    print(f"  decode kernel, R query rows of one request (ms per call, best of {args.cpu_repeats}; "
          f"x: the cost of one row):")
    for int8 in (False, True):
        for context in (2048, 6144):
            data = paged_batch(8, context, heads, torch.device("cpu"))
            k, v, pages = data.k_cache.float(), data.v_cache.float(), None
            if int8:
                pages = QuantizedPages(BLOCK_SIZE, heads.kv_heads, heads.head_dim)
                k8, v8 = (torch.zeros(k.shape[0], pages.page_bytes, dtype=torch.uint8) for _ in range(2))
                pages.store(k.flatten(0, 1), v.flatten(0, 1), k8, v8, torch.arange(k.shape[0] * BLOCK_SIZE))
                k, v = k8, v8
            one = None
            for rows in (1, 4, 8):
                q = torch.randn(rows, heads.num_heads, heads.head_dim)
                lens = torch.arange(context - rows + 1, context + 1, dtype=torch.int32)
                same = data.block_tables[:1].repeat(rows, 1).contiguous()
                apart = data.block_tables[:rows].contiguous()
                full = torch.full((rows,), context, dtype=torch.int32)
                times = _best_cpu_times({
                    "one call": lambda: kernels.decode(q, k, v, same, lens, scale, pages),
                    "a call per row": lambda: [kernels.decode(q[i : i + 1], k, v, same[i : i + 1], lens[i : i + 1],
                                                              scale, pages) for i in range(rows)],
                    "rows of R requests": lambda: kernels.decode(q, k, v, apart, full, scale, pages),
                }, args.cpu_repeats)
                one = one or times["one call"]
                for name, t in times.items():
                    figures.add(f"{'int8' if int8 else 'float32'} {context} R={rows}", name, t * 1e3)
                cells = "  ".join(f"{name} {t * 1e3:6.2f} ms ({t / one:4.1f}x)" for name, t in times.items())
                print(f"    {'int8' if int8 else 'float32':7s} context {context:5d} R={rows}: {cells}")


def bench_cpu_routing(args: argparse.Namespace, figures: Figures) -> None:
    """Where the runner's ROWS_ATTENTION_WORK should sit: 8 decoding requests plus one
    --routing-prompt-token prompt computed in chunks (chunked_prefill_size), on two engines of
    the default model stepping in turns, one that always lays a small step's prompt chunk out
    as single-query rows (the native decoder's one C call, attention in the decode kernel) and
    one that never does (the layer path, the chunk in the tiled prefill kernel). Median ms per
    step by the chunk's context, with rows x context, the work the runner compares."""
    import statistics

    import radixserve.execution.runner as runner
    from bench.lib.harness import seeded_prompt, settle
    from radixserve import Engine, SamplingParams

    work = {"rows": 1 << 62, "tiled": -1}
    params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    print(f"routing: 8 decodes + a {args.routing_prompt}-token prompt in chunks; ms per step, rows / tiled "
          f"(ROWS_ATTENTION_WORK now {runner.ROWS_ATTENTION_WORK})")
    for chunk in args.routing_chunks:
        engines = {name: Engine(chunked_prefill_size=chunk) for name in work}
        times = {name: {} for name in work}
        for name, engine in engines.items():
            runner.ROWS_ATTENTION_WORK = work[name]
            for i in range(8):
                engine.add_request(seeded_prompt(i, 300), params)
            settle(engine)
            engine.add_request(seeded_prompt(99, args.routing_prompt), params)
        for step in range(-(-args.routing_prompt // chunk)):
            context = min((step + 1) * chunk, args.routing_prompt)
            for name, engine in engines.items():
                runner.ROWS_ATTENTION_WORK = work[name]
                t0 = time.perf_counter()
                engine.step()
                times[name].setdefault(context // 1024, []).append(time.perf_counter() - t0)
        for bucket in sorted(times["rows"]):
            ms = {name: statistics.median(times[name][bucket]) * 1e3 for name in work}
            mid = bucket * 1024 + 512
            for name in work:
                figures.add(f"chunk {chunk}, context {bucket * 1024}+", name, ms[name])
            print(f"  chunk {chunk:3d} context {bucket * 1024:5d}-{bucket * 1024 + 1023:5d} (work ~{chunk * mid:7d}): "
                  f"rows {ms['rows']:6.1f} ms  tiled {ms['tiled']:6.1f} ms  rows/tiled {ms['rows'] / ms['tiled']:.2f}")
        del engines


def _best_cpu_times(calls: dict, repeats: int) -> dict[str, float]:
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    for fn in calls.values():
        fn()
    best = {name: float("inf") for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = clock()
            fn()
            best[name] = min(best[name], clock() - start)
    return best


def bench_cpu_quantized(args: argparse.Namespace, figures: Figures) -> None:
    """The default model's layer matmul shapes with quantized weights, side by side: radixserve's
    integer kernel (kernels/quant_linear.py) on int8 per-channel and int4 groups-of-32 weights,
    torch's weight-only ops on the same values (_weight_int8pack_mm; _weight_int4pack_mm_for_cpu),
    and the float32 skinny kernel / oneDNN on the dequantized weight. Best of --cpu-repeats."""
    from radixserve.kernels.native_ops import skinny_linear
    from radixserve.kernels.onednn_linear import onednn_linear
    from radixserve.kernels.quant_linear import quant_linear, quantize

    gen = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    print(f"quantized weights, the default model's four layer shapes summed, torch threads {torch.get_num_threads()}, "
          f"best of {args.cpu_repeats} (microseconds)")
    print(f"  {'rows':>5} {'ours int8':>10} {'torch int8':>11} {'ours int4':>10} {'torch int4':>11} {'float32':>9}")
    layers = []
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) * 0.05
        q8, q4 = quantize(w, 8), quantize(w, 4, 32)
        i8 = (q8.codes.to(torch.int16) - 128).to(torch.int8)
        u4 = torch.cat([(q4.codes & 15).reshape(n, -1, 1, 32), (q4.codes >> 4).reshape(n, -1, 1, 32)], 2).reshape(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u4.to(torch.int32), 8)
        # torch's int4: w = (q - 8) * scale + zero; ours: w = scale * q + offset
        zeros = torch.stack([q4.scale.float().T, (q4.offset.float() + 8 * q4.scale.float()).T], dim=2).contiguous()
        layers.append((w, q8, q4, i8, packed, zeros))
    for rows in (1, 2, 4, 8, 16, 32, 128):
        xs = {k: torch.randn(rows, k, generator=gen) for _, k in shapes}

        def run(fn):
            return lambda: [fn(xs[w.shape[1]], w, q8, q4, i8, packed, zeros) for w, q8, q4, i8, packed, zeros in layers]

        def dense(x, w):
            out = skinny_linear(x, w, None)
            return out if out is not None else onednn_linear(x, w, None)

        best = _best_cpu_times({
            "ours int8": run(lambda x, w, q8, *_: quant_linear(x, q8)),
            "torch int8": run(lambda x, w, q8, q4, i8, *_: torch._weight_int8pack_mm(
                x, i8, q8.scale.float().reshape(-1))),
            "ours int4": run(lambda x, w, q8, q4, *_: quant_linear(x, q4)),
            "torch int4": run(lambda x, w, q8, q4, i8, packed, zeros: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, packed, 32, zeros)),
            "float32": run(lambda x, w, *_: dense(x, w)),
        }, args.cpu_repeats)
        us = {name: t * 1e6 for name, t in best.items()}
        for name, t in best.items():
            figures.add(f"{rows} rows", name, t * 1e3)
        print(f"  {rows:>5} {us['ours int8']:>10.0f} {us['torch int8']:>11.0f} {us['ours int4']:>10.0f} "
              f"{us['torch int4']:>11.0f} {us['float32']:>9.0f}")


# ---- main --------------------------------------------------------------------------------


def main() -> None:
    parser = bench_parser(__doc__, quick="smaller batches and contexts, 2 CPU repeats, a 1024-token routing prompt",
                          json_help="write every time measured here (JSON, ms)",
                          plot="write a bar chart of the times here (PNG)")
    parser.add_argument("--engine", action="store_true", help="run the engine throughput comparison instead")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=4096)
    parser.add_argument("--extend-batch", type=int, default=8)
    parser.add_argument("--cpu", action="store_true", help="the CPU kernels instead (no GPU needed)")
    parser.add_argument("--cpu-repeats", type=int, default=5)
    parser.add_argument("--cpu-rows", action="store_true", help="with --cpu: only the decode kernel on several rows")
    parser.add_argument("--cpu-quantized", action="store_true",
                        help="with --cpu: only the quantized-weight matmuls against torch's weight-only ops")
    parser.add_argument("--cpu-routing", action="store_true",
                        help="with --cpu: only the step-time measurement behind the runner's ROWS_ATTENTION_WORK")
    parser.add_argument("--routing-chunks", type=int, nargs="+", default=[16, 40, 100])
    parser.add_argument("--routing-prompt", type=int, default=4096)
    args = parser.parse_args()
    apply_quick(parser, args, prompts=16, decode_batch=16, decode_context=1024, extend_batch=2, cpu_repeats=2,
                routing_prompt=1024)
    figures = Figures()
    _run(args, figures)
    figures.finish(args, "kernel times", "ms")


def _run(args: argparse.Namespace, figures: Figures) -> None:
    if args.cpu:
        with torch.inference_mode():
            if args.cpu_routing:
                bench_cpu_routing(args, figures)
                return
            if args.cpu_quantized:
                bench_cpu_quantized(args, figures)
                return
            if not args.cpu_rows:
                bench_cpu(args, figures)
            bench_cpu_decode_rows(args, figures)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU")
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = peak_bandwidth(name)
    print(f"device: {name}; peak HBM bandwidth: {f'{peak:.0f} GB/s' if peak else 'unknown (GB/s printed alone)'}")
    print(f"torch {torch.__version__}")
    if args.engine:
        bench_engine(args, figures)
        return
    import triton

    print(f"triton {triton.__version__}")
    for heads in HEAD_CONFIGS:
        bench_decode(heads, args.decode_batch, args.decode_context, device, peak, figures)
    for heads in HEAD_CONFIGS:
        bench_extend(heads, args.extend_batch, 2048, 256, device, peak, figures)
    print("\ntarget: decode attention (auto split, graph time) at >= 60% of peak bandwidth")


if __name__ == "__main__":
    main()
