"""The layer ops of kernels/csrc/layer_ops.c against eager torch and torch.compile, on CPU in float32.

    python -m bench.bench_layer_ops                 # SmolLM2-135M's shapes, rows 1, 8, 32, 512
    python -m bench.bench_layer_ops --rows 1,32 --json layer_ops.json

For RMSNorm (x [T, hidden]), rotary (q, k views of the fused qkv row, cos/sin [T, 1, head_dim])
and the MLP's SiLU gate (gate_up [T, 2 * intermediate]) it times three implementations of
the same computation, each checked against eager first:
  C        radixserve.kernels.native_ops (what the model runs on CPU in float32; rotary in place)
  eager    the torch ops the model falls back to (F.rms_norm; q*cos + rotate_half(q)*sin; silu(gate)*up)
  compile  torch.compile(eager, dynamic=False, fullgraph=True): inductor's C++ kernel for that shape
Each figure is the best of --repeats rounds (each runs the three in turn, ~10 ms of calls
each, so that all see the same neighbours), under
torch.inference_mode as in the model, on torch's default threads (--threads to change; the
C kernels' OpenMP regions share torch's pool). Compile time is reported apart. Run it alone:
on a busy machine the figures measure the neighbours too, and a parallel region waits for
a descheduled thread (--threads 1 avoids that, for all three alike).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.lib.cli import Figures, apply_quick, bench_parser, write_json
from radixserve.kernels import native_ops


def rms_eager(x, weight, eps):
    return F.rms_norm(x, weight.shape, weight, eps)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_eager(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_eager(gate_up):
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def rope_c(q, k, cos, sin):
    assert native_ops.rope_(q, k, cos, sin)
    return q, k


def cases(rows: int, shapes: argparse.Namespace) -> list[tuple[str, str, Callable, Callable, Callable]]:
    """(op, shape, inputs factory, C function, eager function) for one row count."""
    gen = torch.Generator().manual_seed(rows)
    hidden, heads, kv_heads, head_dim, inter = (shapes.hidden, shapes.heads, shapes.kv_heads,
                                                shapes.head_dim, shapes.intermediate)
    weight = torch.randn(hidden, generator=gen)

    def rms_inputs():
        return (torch.randn(rows, hidden, generator=gen), weight, 1e-5)

    def rope_inputs():
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen)
        q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
        angles = torch.rand(rows, 1, head_dim // 2, generator=gen) * 6
        return q, k, torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def silu_inputs():
        return (torch.randn(rows, 2 * inter, generator=gen),)

    return [
        ("rmsnorm", f"[{rows}, {hidden}]", rms_inputs, native_ops.rms_norm, rms_eager),
        ("rotary", f"q [{rows}, {heads}, {head_dim}] k [{rows}, {kv_heads}, {head_dim}]", rope_inputs, rope_c, rope_eager),
        ("silu_gate", f"[{rows}, {2 * inter}]", silu_inputs, native_ops.silu_mul, silu_eager),
    ]


def best_ms(variants: dict[str, tuple[Callable, tuple]], repeats: int) -> dict[str, float]:
    """Best mean milliseconds per call of each variant over `repeats` rounds; each round runs
    every variant in turn (so all see the same neighbours) for ~10 ms of calls, the count
    sized from the fastest of a few single calls (one slow call does not shrink it)."""
    calls = {}
    for name, (fn, args) in variants.items():
        single = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            fn(*args)
            single = min(single, time.perf_counter() - start)
        calls[name] = max(5, min(1 << 20, int(0.01 / max(single, 1e-7))))
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(repeats):
        for name, (fn, args) in variants.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                fn(*args)
            best[name] = min(best[name], (time.perf_counter() - start) / calls[name])
    return {name: seconds * 1e3 for name, seconds in best.items()}


def _same(got, want) -> None:
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def measure(make_inputs: Callable, c_fn: Callable, eager_fn: Callable, repeats: int) -> dict:
    fresh = make_inputs()
    want = eager_fn(*fresh)
    _same(c_fn(*[t.clone() if isinstance(t, torch.Tensor) else t for t in fresh]), want)
    variants = {"c": (c_fn, make_inputs()), "eager": (eager_fn, make_inputs())}
    row = {}
    try:
        compiled = torch.compile(eager_fn, dynamic=False, fullgraph=True)
        start = time.perf_counter()
        _same(compiled(*fresh), want)
        row["compile_s"] = time.perf_counter() - start
        variants["compiled"] = (compiled, make_inputs())
    except Exception as exc:  # noqa: BLE001  (report why inductor could not compile here)
        row["compile_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    row.update({f"{name}_ms": ms for name, ms in best_ms(variants, repeats).items()})
    return row


def main() -> None:
    parser = bench_parser(__doc__, quick="rows 1 and 32, best of 5", json_help="also write the figures here (JSON)",
                          plot="write a bar chart of each op's C / eager / compiled ms here (PNG)")
    parser.add_argument("--rows", default="1,8,32,512", help="token rows per call (decode sizes, a prefill size)")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, help="torch (and so OpenMP) threads; default: torch's own")
    args = parser.parse_args()
    apply_quick(parser, args, rows="1,32", repeats=5)
    if args.threads:
        torch.set_num_threads(args.threads)
    if native_ops._load("rms_norm_f32") is None:
        raise SystemExit("the C layer ops are unavailable here (no compiler, or RADIXSERVE_NATIVE_CPU=0)")

    print(f"layer ops, float32 on CPU, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
          f"shapes of a model with hidden {args.hidden}, {args.heads}/{args.kv_heads} heads x {args.head_dim}, "
          f"intermediate {args.intermediate}; best of {args.repeats}")
    header = f"{'op':10s} {'rows':>5s}  {'C ms':>9s} {'eager ms':>9s} {'compile ms':>10s}  {'eager/C':>7s} {'compile/C':>9s}  shape"
    print(header)
    print("-" * len(header))
    results = []
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            for op, shape, make_inputs, c_fn, eager_fn in cases(rows, args):
                row = {"op": op, "rows": rows, "shape": shape,
                       **measure(make_inputs, c_fn, eager_fn, args.repeats)}
                results.append(row)
                compiled = row.get("compiled_ms")
                print(f"{op:10s} {rows:5d}  {row['c_ms']:9.4f} {row['eager_ms']:9.4f} "
                      f"{compiled if compiled is not None else float('nan'):10.4f}  "
                      f"{row['eager_ms'] / row['c_ms']:7.2f} "
                      f"{(compiled or float('nan')) / row['c_ms']:9.2f}  {shape}")
    errors = {r["compile_error"] for r in results if "compile_error" in r}
    for error in errors:
        print(f"torch.compile failed: {error}")
    compile_times = [r["compile_s"] for r in results if "compile_s" in r]
    if compile_times:
        print(f"torch.compile: {min(compile_times):.1f}-{max(compile_times):.1f} s per op and shape (first call)")
    wins = sum(1 for r in results if r["c_ms"] <= min(r["eager_ms"], r.get("compiled_ms", float("inf"))))
    print(f"C fastest in {wins} of {len(results)} cases (ratios > 1: the C kernel is faster)")
    if args.json:
        write_json(args.json, results, args)
    if args.plot:
        _plot(args.plot, results)


def _plot(path: str, results: list[dict]) -> None:
    figures = Figures()
    for row in results:
        for series, key in (("C", "c_ms"), ("eager", "eager_ms"), ("compiled", "compiled_ms")):
            if row.get(key) is not None:
                figures.add(f"{row['op']} x{row['rows']}", series, row[key])
    figures.finish(argparse.Namespace(json=None, plot=path), "layer ops, float32 on CPU", "ms")


if __name__ == "__main__":
    main()
