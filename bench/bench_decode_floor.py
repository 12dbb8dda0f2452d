"""How near a decode step comes to the memory floor: this machine's bandwidth (a STREAM-like
triad over all cores) and each decode step's share of it, at batch 1 and 8.

    .venv/bin/python -m bench.bench_decode_floor                        # the default model (SmolLM2 Q4_1)
    .venv/bin/python -m bench.bench_decode_floor --model gemma3-270m    # Gemma 3 270M (Q4_K_M, hybrid KV)
    .venv/bin/python -m bench.bench_decode_floor --llama-server PATH    # plus llama.cpp's server on the same file
    .venv/bin/python -m bench.bench_decode_floor --quick --json floor.json

bandwidth  a[i] = b[i] + s * c[i] over float32 arrays of --triad-mib MiB each (far past the L3
           cache), torch's threads on every core; bytes counted as STREAM does (two reads and a
           write a element), the best of --repeats runs. A plain copy (one read, one write) too.
floor      a step must read every weight once (the tied embedding read whole as the head, one row
           as the embedding; an untied embedding one row a token) and each request's KV (every
           cached token in full-attention layers, at most the window in sliding ones): bytes / the
           triad's bandwidth. Share = floor / measured step (1.0 would be the floor itself).
step       the median of --steps engine steps over --prompt-len-token prompts, EOS ignored, no
           speculation (a decode step as bench/profile_decode.py times it).
llama.cpp  with --llama-server (or $LLAMA_SERVER): its server on the same GGUF file and radixserve's
           server, the same streamed requests to each (bench/lib/weights_speed.py's decode workloads):
           tokens/s, the step time that implies, its share of the floor, and radixserve / llama.cpp.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from bench.lib.cli import Figures, apply_quick, bench_parser
from bench.lib.peers import add_llama_server
from radixserve import Engine, SamplingParams
from radixserve.attention.kv_pool import KVPool

TARGET_SHARE = 0.70  # batch-1 decode of the default model: its share of the floor
SERVED_KV_BYTES = 256 << 20  # radixserve's KV pool when served (llama.cpp: -c 512 tokens a slot, f32)


@dataclass
class Bandwidth:
    triad_gbs: float
    copy_gbs: float
    array_mib: int
    threads: int


def bandwidth(array_mib: int, repeats: int) -> Bandwidth:
    """Best-of-`repeats` triad and copy GB/s over arrays of `array_mib` MiB, all torch threads."""
    n = (array_mib << 20) // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    torch.add(b, c, alpha=3.0, out=a)  # page everything in
    a.copy_(b)
    triad = copy = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        triad = max(triad, 3 * 4 * n / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        a.copy_(c)
        copy = max(copy, 2 * 4 * n / (time.perf_counter() - t0))
    return Bandwidth(triad / 1e9, copy / 1e9, array_mib, torch.get_num_threads())


def weight_bytes_read(engine: Engine, batch: int) -> int:
    """Bytes of weights one decode step of `batch` tokens reads."""
    model, spec = engine.runner.model, engine.loaded.spec
    total = model.weight_bytes()
    embed = _module_bytes(model.embed_tokens)
    if model.lm_head is not None:  # untied: the embedding is looked up, one row a token
        total -= embed - batch * embed // spec.vocab_size
    return total


def _module_bytes(module: torch.nn.Module) -> int:
    quant = getattr(module, "quant", None)
    if quant is not None:
        return quant.nbytes
    return sum(p.numel() * p.element_size() for p in module.parameters())


def kv_bytes_read(engine: Engine, contexts: list[int]) -> int:
    """Bytes of K and V the step's attention reads for requests at these context lengths."""
    spec, cfg = engine.loaded.spec, engine.config
    shape, storage = KVPool.geometry(1, cfg.block_size, spec.num_kv_heads, spec.head_dim, engine.dtype,
                                     cfg.kv_cache_dtype)
    per_layer_token = torch.Size(shape).numel() * torch.empty(0, dtype=storage).element_size() / cfg.block_size
    tokens = sum(min(ctx, w) if w else ctx for ctx in contexts for w in spec.layer_windows)
    return int(tokens * per_layer_token)


def step_ms(engine: Engine, batch: int, steps: int, prompt_len: int) -> tuple[float, list[int]]:
    """Median ms of `steps` decode steps of `batch` requests, and their context lengths midway."""
    prompts = [[100 + (i * 7919 + j * 31) % 20000 for j in range(prompt_len)] for i in range(batch)]
    greedy = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True, speculative=False)
    for p in prompts:
        engine.add_request(p, greedy)
    while engine.scheduler.waiting or any(r.in_prefill for r in engine.scheduler.running):
        engine.step()
    for _ in range(2):  # warm
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    contexts = [prompt_len + 2 + steps // 2] * batch
    for rid in engine.unfinished_request_ids():
        engine.abort(rid)
    return statistics.median(times) * 1000, contexts


def floor_rows(engine: Engine, bw: Bandwidth, args) -> list[dict]:
    rows = []
    for batch in args.batches:
        ms, contexts = step_ms(engine, batch, args.steps, args.prompt_len)
        weights, kv = weight_bytes_read(engine, batch), kv_bytes_read(engine, contexts)
        floor = (weights + kv) / (bw.triad_gbs * 1e9) * 1000
        rows.append({"batch": batch, "threads": engine.cpu_share.snapshot().threads, "step_ms": ms, "tokens_s": 1000 * batch / ms, "weight_mib": weights / 2**20,
                     "kv_mib": kv / 2**20, "floor_ms": floor, "share": floor / ms, "context": contexts[0]})
    return rows


def llama_rows(args, rows: list[dict], bw: Bandwidth) -> list[dict]:
    """llama.cpp's server and radixserve's on the same file, the same decode requests."""
    import asyncio

    from bench.lib.servers import radixserve_command, serving
    from bench.lib.weights_speed import measure
    from radixserve.model.default_model import default_gguf_path
    from radixserve.model.packaged_models import packaged_gguf

    gguf = default_gguf_path() if args.model is None else packaged_gguf(args.model)
    slots, ctx = max(args.batches), max(args.batches) * 512
    model_args = [] if args.model is None else ["--model", args.model]
    systems = [("llama.cpp", [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "-c", str(ctx),
                              "-np", str(slots), "-ctk", "f32", "-ctv", "f32", "-t", str(args.llama_threads),
                              "-tb", str(args.llama_threads), "-cram", "0", "--alias", "m"]),
               ("radixserve", radixserve_command(*model_args, "--kv-cache-memory", str(SERVED_KV_BYTES)))]
    floors = {r["batch"]: r["floor_ms"] for r in rows}
    out = []
    for label, command in systems:
        with serving(command) as (url, _):
            for batch in args.batches:
                rate = asyncio.run(measure(url, f"decode b{batch}", args))
                ms = 1000 * batch / rate
                out.append({"system": label, "batch": batch, "tokens_s": rate, "step_ms": ms,
                            "share": floors[batch] / ms})
                print(f"  {label} decode b{batch}: {rate:.1f} tokens/s", flush=True)
    return out


def report(model: str, bw: Bandwidth, rows: list[dict], served: list[dict]) -> None:
    print(f"\nmemory bandwidth: triad {bw.triad_gbs:.1f} GB/s, copy {bw.copy_gbs:.1f} GB/s "
          f"({bw.array_mib} MiB arrays, {bw.threads} threads, best of the repeats)")
    print(f"decode steps of {model} (engine steps, no speculation; floor = bytes read / triad bandwidth)")
    print(f"  {'batch':>5} {'threads':>7} {'context':>7} {'weights MiB':>11} {'KV MiB':>7} {'floor ms':>8} {'step ms':>8} "
          f"{'tokens/s':>9} {'share of floor':>14}")
    for r in rows:
        print(f"  {r['batch']:>5} {r['threads']:>7} {r['context']:>7} {r['weight_mib']:>11.1f} {r['kv_mib']:>7.2f} {r['floor_ms']:>8.2f} "
              f"{r['step_ms']:>8.2f} {r['tokens_s']:>9.1f} {r['share']:>13.1%}")
    one = next((r for r in rows if r["batch"] == 1), None)
    if one is not None and model == "default":
        verdict = "meets target" if one["share"] >= TARGET_SHARE else "BELOW target"
        print(f"  batch 1: {one['share']:.1%} of the floor (target >= {TARGET_SHARE:.0%}) [{verdict}]")
    if served:
        print("served (the same streamed requests to each server; step = batch / tokens/s)")
        for r in served:
            print(f"  {r['system']:<10} b{r['batch']:<3} {r['tokens_s']:8.1f} tokens/s  step {r['step_ms']:6.2f} ms  "
                  f"share of floor {r['share']:.1%}")
        by = {(r["system"], r["batch"]): r["tokens_s"] for r in served}
        for batch in sorted({r["batch"] for r in served}):
            print(f"  radixserve / llama.cpp at batch {batch}: "
                  f"{by[('radixserve', batch)] / by[('llama.cpp', batch)]:.2f}x tokens/s")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="a 256 MiB triad, 3 repeats, 16 steps, 64 new tokens, one repetition served")
    p.add_argument("--model", default=None, choices=[None, "gemma3-270m"], help="default: SmolLM2 Q4_1")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=48, help="decode steps timed per batch")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--triad-mib", type=int, default=512, help="MiB per triad array (L3 here: 32 MiB)")
    p.add_argument("--repeats", type=int, default=10)
    add_llama_server(p, "a llama.cpp llama-server binary (default: $LLAMA_SERVER): served side by side")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--new-tokens", type=int, default=128, help="tokens a served decode request generates")
    p.add_argument("--reps", type=int, default=3, help="served runs per workload (median)")
    args = p.parse_args(argv)
    apply_quick(p, args, triad_mib=256, repeats=3, steps=16, new_tokens=64, reps=1)
    bw = bandwidth(args.triad_mib, args.repeats)
    engine = Engine(args.model)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm-up
    rows = floor_rows(engine, bw, args)
    del engine
    served = llama_rows(args, rows, bw) if args.llama_server else []
    model = args.model or "default"
    report(model, bw, rows, served)
    figures = Figures()
    for r in rows:
        figures.add(f"batch {r['batch']}", "step ms", r["step_ms"], **r)
        figures.add(f"batch {r['batch']}", "floor ms", r["floor_ms"])
    for r in served:
        figures.add(f"batch {r['batch']}", f"{r['system']} served step ms", r["step_ms"], **r)
    figures.finish(args, f"decode step against the memory floor ({model}; triad {bw.triad_gbs:.1f} GB/s)", "ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
