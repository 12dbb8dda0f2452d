"""int8 KV pages (--kv-cache-dtype int8) against full-precision KV on the default model.

    .venv/bin/python -m bench.bench_kv_quant                 # everything (a few minutes on 2 cores)
    .venv/bin/python -m bench.bench_kv_quant --quick         # fewer prompts, positions and shapes
    .venv/bin/python -m bench.bench_kv_quant --plot kv_quant.png
    .venv/bin/python -m bench.bench_kv_quant --clock cpu     # CPU seconds on one thread (a loaded machine)

  accuracy   greedy continuations (--new-tokens, 64) of every prompt in bench/lib/kv_quant_prompts.py
             (raw text, and chat through the template) by two engines, float32 KV and quantized
             KV (each of --kv-dtypes: int8, and optionally fp8_e4m3) on the same attention
             backend (int8: the C kernels; fp8_e4m3: torch, the one CPU path that reads fp8):
             the share of identical outputs and the mean agreeing prefix; then teacher-forced
             next-token distributions over each prompt plus its float32 continuation
             (--tf-tokens long): top-1 agreement and mean KL(float32 || quantized) in nats
  capacity   blocks at the same kv_cache_memory, int8 (and fp8_e4m3, the same page) vs float32
  speed      one decode step of the whole model (the native decoder, C attention) at each
             batch x context, int8 vs float32 in turns, over a filled pool whose block tables
             are random (no shared prefix); median ms, and the KV bytes a step reads. --clock cpu
             runs on one thread and counts its CPU time, for a machine that others load too
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.lib.cli import apply_quick, bench_parser, write_json
from bench.lib.kv_quant_prompts import BLOCK, CHAT, RAW, attention_metadata, tokenized_prompts
from radixserve import Engine, SamplingParams
from radixserve.attention.cpu_backend import CpuAttentionBackend
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.registry import get_backend_class, resolve_backend_name
from radixserve.model.native_decoder import NativeDecoder

DTYPES = ("auto", "int8")
TARGETS = {"top1": 0.99, "kl": 0.01, "capacity": 3.5}
# The attention backend each quantized dtype's accuracy runs on, float32 reference included
# (auto: the C kernels here; they read no fp8 pages, so fp8 runs through torch).
ACCURACY_BACKENDS = {"int8": "auto", "fp8_e4m3": "torch"}


def main() -> None:
    args = _args()
    torch.manual_seed(0)
    if args.clock == "cpu":
        torch.set_num_threads(1)
    engines = {"auto": Engine(kv_cache_memory=args.kv_memory_mb << 20)}
    report = {"capacity": capacity(engines["auto"]), "accuracy": {}, "speed": []}
    if "accuracy" in args.parts:
        prompts = tokenized_prompts(engines["auto"], args.prompts)
        report["accuracy"] = {d: accuracy(engines["auto"], d, prompts, args) for d in args.kv_dtypes}
    model, spec = engines["auto"].runner.model, engines["auto"].loaded.spec
    del engines
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if "speed" in args.parts:
        report["speed"] = speed(model, spec, args.batches, args.contexts, args.reps, args.pool_mb, clock)
    _print(report, args)
    if args.json:
        write_json(args.json, report, args)
    if args.plot:
        _plot(args.plot, report)


# ---- accuracy -----------------------------------------------------------------------------------


def accuracy(base: Engine, kv_dtype: str, prompts: list[list[int]], args) -> dict:
    """kv_dtype's pages against float32 KV, both on ACCURACY_BACKENDS[kv_dtype] (`base`:
    float32 on auto)."""
    backend, memory = ACCURACY_BACKENDS[kv_dtype], args.kv_memory_mb << 20
    engines = {"auto": base if backend == "auto" else Engine(attention_backend=backend, kv_cache_memory=memory),
               kv_dtype: Engine(kv_cache_dtype=kv_dtype, attention_backend=backend, kv_cache_memory=memory)}
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    outs = {d: [o.token_ids for o in e.generate(prompts, greedy, use_tqdm=False)] for d, e in engines.items()}
    prefixes = [_agreeing(a, b) for a, b in zip(outs["auto"], outs[kv_dtype])]
    print(f"  accuracy {kv_dtype}: greedy done, {sum(n == args.new_tokens for n in prefixes)}/{len(prompts)} identical",
          flush=True)
    forced = SamplingParams(max_tokens=args.tf_tokens, temperature=0.0, ignore_eos=True)
    sequences = [p + o.token_ids for p, o in zip(prompts, engines["auto"].generate(prompts, forced, use_tqdm=False))]
    model, spec = base.runner.model, base.loaded.spec
    backend_class = get_backend_class(resolve_backend_name(backend, torch.device("cpu")))
    del engines
    agree = kl = positions = 0
    for seq in sequences:
        full, quant = (teacher_forced_logits(model, spec, seq, d, backend_class) for d in ("auto", kv_dtype))
        p, q = torch.log_softmax(full.double(), -1), torch.log_softmax(quant.double(), -1)
        agree += int((full.argmax(-1) == quant.argmax(-1)).sum())
        kl += float((p.exp() * (p - q)).sum())
        positions += len(seq)
        print(f"  accuracy {kv_dtype}: {positions} positions forced, top-1 {agree / positions:.2%}", end="\r",
              flush=True)
    return {
        "kv_dtype": kv_dtype, "backend": backend, "prompts": len(prompts), "new_tokens": args.new_tokens,
        "identical": sum(n == args.new_tokens for n in prefixes) / len(prompts),
        "mean_prefix": statistics.mean(prefixes), "positions": positions,
        "top1": agree / positions, "kl": kl / positions,
    }


def teacher_forced_logits(model, spec, tokens: list[int], kv_cache_dtype: str, backend_class) -> torch.Tensor:
    """Next-token logits at every position of `tokens`, computed as one prompt chunk over a
    fresh pool of that KV dtype (every position attends to its context as the pages hold it)."""
    n, blocks = len(tokens), -(-len(tokens) // BLOCK)
    pool = KVPool(spec.num_layers, blocks, BLOCK, spec.num_kv_heads, spec.head_dim, torch.float32,
                  torch.device("cpu"), kv_cache_dtype)
    backend = backend_class(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim**-0.5,
                            torch.float32, pool.pages)
    meta = attention_metadata(0, [0, n], [n], [list(range(blocks))], list(range(n)))
    plan = backend.prepare(meta)
    ids, positions = torch.tensor(tokens), torch.arange(n)
    return model(ids, positions, backend, pool, plan, torch.arange(n))


# ---- capacity -----------------------------------------------------------------------------------


def capacity(engine: Engine) -> dict:
    spec, memory = engine.loaded.spec, 1 << 30
    geometry = (spec.num_layers, BLOCK, spec.num_kv_heads, spec.head_dim, torch.float32)
    per_block = {d: KVPool.bytes_per_block(*geometry, kv_cache_dtype=d) for d in (*DTYPES, "fp8_e4m3")}
    blocks = {d: memory // b for d, b in per_block.items()}
    return {"memory": memory, "bytes_per_token": {d: b / BLOCK for d, b in per_block.items()},
            "blocks": blocks, "ratio": blocks["int8"] / blocks["auto"]}


# ---- speed --------------------------------------------------------------------------------------


def speed(model, spec, batches: list[int], contexts: list[int], reps: int, pool_mb: int, clock) -> list[dict]:
    model.native = NativeDecoder.for_model(spec, model.layers)
    per_block_f32 = KVPool.bytes_per_block(spec.num_layers, BLOCK, spec.num_kv_heads, spec.head_dim, torch.float32)
    num_blocks = max(-(-max(contexts) // BLOCK) + 1, (pool_mb << 20) // per_block_f32)
    pools = {d: _filled_pool(spec, num_blocks, d) for d in DTYPES}
    rows = []
    for context in contexts:
        for batch in batches:
            times = {d: [] for d in DTYPES}
            step = _decode_step(spec, num_blocks, batch, context)
            for rep in range(reps + 1):  # the first of each is a warm-up
                for d in DTYPES:
                    ms = _time_step(model, spec, pools[d], step, clock)
                    if rep:
                        times[d].append(ms)
            ms = {d: statistics.median(t) for d, t in times.items()}
            kv_read = {d: batch * context * pools[d].bytes_per_token for d in DTYPES}
            rows.append({"batch": batch, "context": context, "ms": ms, "kv_read": kv_read,
                         "speedup": ms["auto"] / ms["int8"]})
            print(f"  speed: batch {batch:>2} context {context:>5}: float32 {ms['auto']:8.1f} ms  "
                  f"int8 {ms['int8']:8.1f} ms  ({ms['auto'] / ms['int8']:.2f}x)", flush=True)
    del pools
    return rows


def _filled_pool(spec, num_blocks: int, kv_cache_dtype: str) -> KVPool:
    """A pool whose every byte is written (untouched anonymous pages would read as free zeros)."""
    pool = KVPool(spec.num_layers, num_blocks, BLOCK, spec.num_kv_heads, spec.head_dim, torch.float32,
                  torch.device("cpu"), kv_cache_dtype)
    for i in range(spec.num_layers):
        for cache in pool.layer(i):
            if pool.pages is None:
                cache.normal_()
            else:
                pool.pages.codes(cache).copy_(torch.randint(-127, 128, pool.pages.codes(cache).shape, dtype=torch.int8))
                pool.pages.scales(cache).uniform_(0.001, 0.05)
    return pool


def _decode_step(spec, num_blocks: int, batch: int, context: int) -> dict:
    rng = random.Random(batch * 100003 + context)
    per_request = -(-context // BLOCK)
    tables = [rng.sample(range(num_blocks), per_request) for _ in range(batch)]
    slots = [t[(context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK for t in tables]
    meta = attention_metadata(batch, list(range(batch + 1)), [context] * batch, tables, slots)
    ids = torch.tensor([rng.randrange(100, 40000) for _ in range(batch)])
    return {"meta": meta, "ids": ids, "positions": torch.full((batch,), context - 1)}


def _time_step(model, spec, pool: KVPool, step: dict, clock) -> float:
    backend = CpuAttentionBackend(spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.head_dim**-0.5,
                                  torch.float32, pool.pages)
    plan = backend.prepare(step["meta"])
    rows = torch.arange(step["ids"].shape[0])
    t0 = clock()
    model(step["ids"], step["positions"], backend, pool, plan, rows)
    return (clock() - t0) * 1000


# ---- helpers ------------------------------------------------------------------------------------


def _agreeing(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _print(report: dict, args) -> None:
    acc, cap = report["accuracy"], report["capacity"]
    print("\n" + "=" * 92)
    print("KV cache quantization: int8 pages (codes + one float32 scale per token and KV head) vs float32 KV")
    clock = "CPU time of one thread" if args.clock == "cpu" else "wall time"
    print(f"  default model, torch threads {torch.get_num_threads()}, step times in {clock}; greedy, "
          f"{args.new_tokens} new tokens")
    print("=" * 92)
    for a in acc.values():
        _print_accuracy(a)
    bpt = cap["bytes_per_token"]
    print(f"capacity at {cap['memory'] >> 20} MiB: float32 {cap['blocks']['auto']} blocks ({bpt['auto']:.0f} B/token), "
          f"int8 {cap['blocks']['int8']} blocks ({bpt['int8']:.0f} B/token): {cap['ratio']:.2f}x "
          f"(target >= {TARGETS['capacity']}x) {_verdict(cap['ratio'] >= TARGETS['capacity'])}; "
          f"fp8_e4m3 the same page ({cap['blocks']['fp8_e4m3']} blocks)")
    if not report["speed"]:
        return
    print("decode step, whole model (median ms; KV MiB read per step):")
    print(f"  {'batch':>5} {'context':>7} {'float32':>9} {'int8':>9} {'speedup':>8} {'KV f32':>9} {'KV int8':>9}")
    for r in report["speed"]:
        print(f"  {r['batch']:>5} {r['context']:>7} {r['ms']['auto']:>9.1f} {r['ms']['int8']:>9.1f} "
              f"{r['speedup']:>7.2f}x {r['kv_read']['auto'] / 2**20:>9.0f} {r['kv_read']['int8'] / 2**20:>9.0f}")


def _print_accuracy(acc: dict) -> None:
    print(f"accuracy of {acc['kv_dtype']} (attention backend {acc['backend']}) over {acc['prompts']} prompts "
          f"({len(RAW[: -(-acc['prompts'] // 2)])} raw, the rest chat):")
    print(f"  identical greedy outputs        {acc['identical']:7.1%}")
    print(f"  mean agreeing prefix            {acc['mean_prefix']:7.1f} of {acc['new_tokens']} tokens")
    print(f"  teacher-forced positions        {acc['positions']:7d}")
    print(f"  top-1 agreement                 {acc['top1']:7.2%}   (target >= {TARGETS['top1']:.0%})"
          f"  {_verdict(acc['top1'] >= TARGETS['top1'])}")
    print(f"  mean KL(float32 || quantized)   {acc['kl']:7.4f} nats (target <= {TARGETS['kl']})"
          f"  {_verdict(acc['kl'] <= TARGETS['kl'])}")


def _verdict(ok: bool) -> str:
    return "[meets target]" if ok else "[BELOW target]"


def _plot(path: str, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc, cap, rows = report["accuracy"], report["capacity"], report["speed"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, a in enumerate(acc.values()):
        axes[0].bar([f"{a['kv_dtype']}\nidentical", f"{a['kv_dtype']}\ntop-1"], [a["identical"], a["top1"]],
                    color=[f"C{2 * i}", f"C{2 * i + 1}"])
    if acc:
        axes[0].set_ylim(0, 1.05)
        kls = ", ".join(f"{a['kv_dtype']} {a['kl']:.4f}" for a in acc.values())
        axes[0].set_title(f"quantized vs float32 KV accuracy (KL {kls} nats)")
    axes[1].bar(["float32", "int8"], [cap["blocks"]["auto"], cap["blocks"]["int8"]], color=["C0", "C2"])
    axes[1].set_title(f"KV blocks in {cap['memory'] >> 20} MiB ({cap['ratio']:.2f}x)")
    labels = [f"b{r['batch']}\n{r['context']}" for r in rows]
    xs = range(len(rows))
    axes[2].bar([x - 0.2 for x in xs], [r["ms"]["auto"] for r in rows], 0.4, label="float32")
    axes[2].bar([x + 0.2 for x in xs], [r["ms"]["int8"] for r in rows], 0.4, label="int8")
    axes[2].set_xticks(list(xs))
    axes[2].set_xticklabels(labels)
    axes[2].set_ylabel("decode step ms")
    axes[2].set_yscale("log")
    axes[2].legend()
    axes[2].set_title("decode step time (batch / context)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def _args() -> argparse.Namespace:
    parser = bench_parser(__doc__, quick="20 prompts, 64-token forcing, batch 1/8 x 512/6144")
    parser.add_argument("--prompts", type=int, default=len(RAW) + len(CHAT))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--tf-tokens", type=int, default=200, help="continuation each prompt is forced through")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 6144])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pool-mb", type=int, default=1536, help="float32 pool the speed rows read from")
    parser.add_argument("--kv-memory-mb", type=int, default=512, help="each accuracy engine's KV pool")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--parts", nargs="+", choices=["accuracy", "speed"], default=["accuracy", "speed"],
                        help="what to measure (capacity is always reported)")
    parser.add_argument("--kv-dtypes", nargs="+", choices=list(ACCURACY_BACKENDS), default=["int8"],
                        help="quantized KV dtypes whose accuracy is measured (fp8_e4m3: through the torch backend)")
    args = parser.parse_args()
    apply_quick(parser, args, prompts=20, tf_tokens=64, batches=[1, 8], contexts=[512, 6144])
    args.prompts = min(args.prompts, len(RAW) + len(CHAT))
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    return args


if __name__ == "__main__":
    main()
