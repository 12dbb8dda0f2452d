"""A decode step's quantized matmuls on a real model's repacked weights, cold as in a step.

    .venv/bin/python -m bench.bench_quant_step --model gemma3-270m            # the lm head and the layers
    .venv/bin/python -m bench.bench_quant_step --against /tmp/old/quant_linear.c   # another build, in turns
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.bench_quant_step --rows 1 8

Every quantized weight of the model (its `quantized.safetensors`, as the engine repacked it)
goes through kernels/csrc/quant_linear.c's quant_linear_f32 in the model's order, x random:
"layers" is all the layers' projections (fused q/k/v and gate/up kept apart as stored), "head"
the tied lm head (Gemma 3: 262,144 x 640 Q8_0, ~189 MB a step). The weights together exceed
the last-level cache, so each product reads its weight from memory, as a decode step does.
With --against, a second build of the kernel (another quant_linear.c, with its headers beside
it; one from before the lanes layout gets the weights one feature a row, and one from before
float16 scales does not run) runs in the same
process, the two in turns, and the ratio is reported: the machine's pace
drifts between runs, so compare within one. Min and median of --reps, milliseconds.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.lib.cli import Figures, bench_parser
from radixserve.kernels.native_build import CSRC, SIGNATURES, build_native
from radixserve.kernels.quant_linear import QuantWeight, lanes_preferred


def _kernel(source: Path):
    """The build's quant_linear_f32 and whether it takes a `lanes` argument (builds from before
    the lanes layout do not: they get the rows layout)."""
    fn = build_native(source).quant_linear_f32
    lanes = "int64_t half, int64_t lanes, const float *bias" in source.read_text()  # quant_linear_f32's
    types = list(SIGNATURES["quant_linear_f32"].argtypes)
    fn.argtypes = types if lanes else types[:12] + types[13:]
    fn.restype = ctypes.c_int
    return fn, lanes


def _weights(model: str | None) -> list[tuple[str, QuantWeight]]:
    from safetensors import safe_open

    from radixserve.model.loader import REPACKED_FILE
    from radixserve import Engine

    engine = Engine(model, num_kv_blocks=16)  # converts and repacks once, into the model cache
    path = Path(engine.loaded.path) / REPACKED_FILE
    del engine
    f = safe_open(str(path), "pt")
    meta = json.loads(f.metadata()["quantized"])
    keys = set(f.keys())
    return [(name, QuantWeight.from_saved({part: f.get_tensor(f"{name}::{part}").contiguous()
                                           for part in ("codes", "scale", "offset") if f"{name}::{part}" in keys}, m))
            for name, m in meta.items()]


def _run(build, weights: list[tuple[str, QuantWeight]], xs: dict[int, torch.Tensor]) -> None:
    fn, takes_lanes = build
    for _, w in weights:
        n, k = w.shape
        x = xs[k]
        out = torch.empty(x.shape[0], n)
        head = (x.data_ptr(), x.shape[0], k, w.codes.data_ptr(), w.scale.data_ptr(),
                None if w.offset is None else w.offset.data_ptr(), n, k, w.bits, w.group, w.zero, int(w.half_scales))
        status = fn(*head, int(w.lanes), None, out.data_ptr(), n, 0) if takes_lanes else \
            fn(*head, None, out.data_ptr(), n, 0)
        if status:
            raise RuntimeError(f"quant_linear_f32 refused a weight ({status})")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="3 repetitions")
    p.add_argument("--model", default=None, help="a model name or path (default: the default model)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--against", type=Path, default=None, help="another quant_linear.c to run in turns")
    args = p.parse_args(argv)
    if args.quick:
        args.reps = 3
    rows_layout = _weights(args.model)
    lanes = [(name, w.to_lanes()) for name, w in rows_layout] if lanes_preferred() else rows_layout
    builds = {"this": _kernel(CSRC / "quant_linear.c")}
    if args.against is not None:
        builds = {"against": _kernel(args.against), **builds}
    stored = {b: lanes if build[1] else rows_layout for b, build in builds.items()}
    groups = {"layers": [i for i, (name, _) in enumerate(rows_layout) if "embed_tokens" not in name
                         and "lm_head" not in name],
              "head": [i for i, (name, _) in enumerate(rows_layout) if "embed_tokens" in name or "lm_head" in name]}
    mb = {g: sum(rows_layout[i][1].nbytes for i in ids) / 1e6 for g, ids in groups.items()}
    print(f"{args.model or 'default model'}: layers {mb['layers']:.1f} MB, head {mb['head']:.1f} MB; "
          f"torch threads {torch.get_num_threads()}; min / median of {args.reps} (ms)")
    figures = Figures()
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for _, w in rows_layout}}
        for label, ids in groups.items():
            if not ids:
                continue
            times: dict[str, list[float]] = {b: [] for b in builds}
            for _ in range(args.reps):
                for b, build in builds.items():
                    t0 = time.perf_counter()
                    _run(build, [stored[b][i] for i in ids], xs)
                    times[b].append(time.perf_counter() - t0)
            cells = []
            for b, t in times.items():
                best, med = min(t) * 1e3, statistics.median(t) * 1e3
                figures.add(f"{rows} rows {label}", b, best)
                cells.append(f"{b} {best:7.2f} / {med:7.2f} ({mb[label] / best:5.1f} GB/s)")
            ratio = ""
            if len(times) == 2:
                ratio = f"  this / against: min {min(times['this']) / min(times['against']):.2f}, median " \
                        f"{statistics.median(times['this']) / statistics.median(times['against']):.2f}"
            print(f"  rows {rows:>3} {label:>6}: " + "   ".join(cells) + ratio)
    figures.finish(args, "quantized matmuls of a decode step (best ms)", "ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
