"""The model's matmuls with cold weights: the C kernel (kernels/csrc/skinny_linear.c), oneDNN and MKL.

    python -m bench.bench_matmul                          # rows 1, 2, 4, 8, 16, 32
    python -m bench.bench_matmul --rows 64,128,256,512    # prefill-sized: oneDNN against MKL
    python -m bench.bench_matmul --against old_skinny_linear.c --rows 4,8,16   # A/B two kernel sources

One pass is the default model's 121 matmuls of a decode step (30 layers of qkv 960x576, o
576x576, gate_up 3072x576, down 576x1536, then the 49152x576 LM head), each with its own
weight, ~537 MB in all: far past the caches, so every pass reads its weights from memory as a
real step does. For each row count the systems take turns (--repeats passes each, the first
dropped), and the report gives the median ms per pass, the weights-read floor (bytes over
a copy's bandwidth, measured in the same run) and the ratios to the first system:
  kernel    radixserve.kernels.native_ops.skinny_linear's source, built as the package builds it
  against   (--against FILE) another source of the same kernel, built with the same flags
  onednn    radixserve.kernels.onednn_linear (oneDNN's matmul on the plain weight), where torch has it
  mkl       torch's F.linear (MKL here)
The kernels run only up to the rows their build takes (max_rows).
Every system's output is checked against MKL's first. Run it alone (see bench_layer_ops).
"""

from __future__ import annotations

import ctypes
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.lib.cli import apply_quick, bench_parser, write_json
from bench.lib.report import plot_bars
from radixserve.kernels.native_build import CSRC, SIGNATURES, build_native
from radixserve.kernels.native_ops import max_rows
from radixserve.kernels.onednn_linear import available as onednn_available, onednn_linear

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (features, K) of the default model
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def load(source: Path):
    library = build_native(source)
    if library is None:
        raise SystemExit(f"{source} could not be built here")
    fn = library.skinny_linear_f32
    fn.argtypes = list(SIGNATURES["skinny_linear_f32"].argtypes)
    fn.restype = SIGNATURES["skinny_linear_f32"].restype
    return fn


def kernel_pass(fn):
    def run(weights: list[torch.Tensor], xs: dict[int, torch.Tensor], outs: dict[int, torch.Tensor]) -> None:
        for w in weights:
            n, k = w.shape
            x, out = xs[k], outs[n]
            if fn(x.data_ptr(), x.shape[0], k, w.data_ptr(), n, k, None, out.data_ptr(), n) != 0:
                raise RuntimeError("the kernel refused the shape")
    return run


def onednn_pass(weights, xs, outs) -> None:
    with torch.inference_mode():
        for w in weights:
            outs[w.shape[0]] = onednn_linear(xs[w.shape[1]], w, None)  # its own output: no copy


def mkl_pass(weights, xs, outs) -> None:
    for w in weights:
        torch.mm(xs[w.shape[1]], w.t(), out=outs[w.shape[0]])


def copy_bandwidth_gbs() -> float:
    a = torch.ones(64 * 1024 * 1024)
    b = torch.empty_like(a)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(5))
    return 2 * a.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="rows 1 and 8, 3 passes", json_help="write the medians here (JSON)",
                     plot="write a bar chart of the medians here (PNG)")
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--against", type=Path, help="another skinny_linear.c to compare (built with the same flags)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    apply_quick(p, args, rows="1,8", repeats=3)
    torch.manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    weights = [torch.randn(n, k) for n, k in shapes]
    systems = {"kernel": kernel_pass(load(CSRC / "skinny_linear.c"))}
    if args.against:
        systems["against"] = kernel_pass(load(args.against))
    if onednn_available():
        systems["onednn"] = onednn_pass
    systems["mkl"] = mkl_pass
    floor_ms = sum(w.numel() * 4 for w in weights) / (copy_bandwidth_gbs() * 1e9) * 1000
    print(f"{len(weights)} matmuls, {sum(w.numel() for w in weights) * 4 / 1e6:.0f} MB of float32 weights; "
          f"weights-read floor {floor_ms:.1f} ms; median of {args.repeats - 1} passes each, systems taking turns")
    results = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
        running = {name: run for name, run in systems.items()
                   if name not in ("kernel", "against") or rows <= max_rows()}
        outs = {name: {n: torch.empty(rows, n) for n in {n for n, _ in shapes}} for name in running}
        times: dict[str, list[float]] = {name: [] for name in running}
        for _ in range(args.repeats):
            for name, run in running.items():
                times[name].append(_timed(lambda: run(weights, xs, outs[name])))
        for name in running:
            torch.testing.assert_close(outs[name][VOCAB], outs["mkl"][VOCAB], rtol=1e-4, atol=1e-3)
        med = {name: statistics.median(t[1:]) * 1000 for name, t in times.items()}
        first = next(iter(med))
        ratios = ", ".join(f"{name} {med[name] / med[first]:.2f}x" for name in med if name != first)
        print(f"rows {rows:4d}: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in med.items()) + f"; vs {first}: {ratios}",
              flush=True)
        results[rows] = med
    if args.json:
        write_json(args.json, {"floor_ms": floor_ms, "ms": results}, args)
    if args.plot:
        series = {name: [results[r].get(name, 0.0) for r in results] for name in systems}
        plot_bars(args.plot, f"one pass of the model's matmuls (floor {floor_ms:.1f} ms)", [f"{r} rows" for r in results],
                  series, "ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
