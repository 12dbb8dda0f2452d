"""bench_weights' speed part (bench_decode_floor serves its decode workloads too): the default model served from its Q4_1 file (radixserve auto),
in float32 (radixserve --weight-dtype float32), and by llama.cpp's server on the same file,
one server at a time, the same requests to each, the same KV bytes."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.lib.client import complete
from bench.lib.servers import radixserve_command, resident_mib, serving
from radixserve.model.default_model import default_gguf_path
from radixserve.model.packaged_models import packaged_gguf

SLOTS = 8  # llama.cpp's parallel slots; each must hold the longest prompt
SLOT_TOKENS = 2304
WORKLOADS = ("decode b1", "decode b8", "prompt 512", "prompt 2048")
IDLE_BEFORE_MEMORY_S = 3.0  # every server idles this long before its memory is read


LLAMA_UBATCH = 512  # llama.cpp's default -ub


@dataclass(frozen=True)
class SpeedModel:
    """A model the speed part serves: its GGUF file, how it is named, its layers' float32 KV
    bytes a token (K and V), and its sliding-window layers (how many, how wide)."""

    gguf: Callable[[], Path]
    quant: str
    layers: int
    layer_bytes_per_token: int
    serve_args: tuple[str, ...]
    window_layers: int = 0
    window: int = 0

    def llama_kv_bytes(self, tokens: int) -> int:
        """The KV bytes llama.cpp's server holds at -c `tokens`, -np SLOTS, f32 K and V: every full
        layer all `tokens` cells; each window layer, per slot, the window plus one ubatch padded
        to 256 cells (its llama-kv-cache-iswa.cpp; at -v its log says 108 + 240 MiB for Gemma 3
        270M). radixserve is given these bytes, so that both hold the same KV; llama.cpp runs
        with -cram 0 and -ctxcp 0, so it keeps no prompt cache and no window checkpoints beyond
        them (32 checkpoints a slot by default: +270 MiB on Gemma 3 after the speed workloads)."""
        full = (self.layers - self.window_layers) * tokens
        per_slot = min(tokens // SLOTS, -(-(self.window + LLAMA_UBATCH) // 256) * 256)
        return (full + self.window_layers * SLOTS * per_slot) * self.layer_bytes_per_token


MODELS = {
    "default": SpeedModel(default_gguf_path, "Q4_1", 30, 2 * 3 * 64 * 4, ()),
    "gemma3-270m": SpeedModel(lambda: packaged_gguf("gemma3-270m"), "Q4_K_M", 18, 2 * 1 * 256 * 4,
                              ("--model", "gemma3-270m"), window_layers=15, window=512),
}


def _systems(args, float32: bool) -> tuple[str, list[tuple[str, list[str]]], int, int]:
    """(the base system's label, [(label, command)], KV tokens, KV bytes each server holds)."""
    model = MODELS[args.model]
    tokens = SLOTS * SLOT_TOKENS
    kv_bytes = model.llama_kv_bytes(tokens)
    memory_args = ["--kv-cache-memory", str(kv_bytes), *model.serve_args]
    base = f"radixserve {model.quant}"
    systems = [(base, radixserve_command(*memory_args))]
    if float32:
        systems.append(("radixserve float32", radixserve_command(*memory_args, "--weight-dtype", "float32")))
    if args.llama_server:
        systems.append((f"llama.cpp {model.quant}", [
            args.llama_server, "-m", str(model.gguf()), "--host", "127.0.0.1", "-c", str(tokens), "-np", str(SLOTS),
            "-ctk", "f32", "-ctv", "f32", "-t", str(args.llama_threads), "-tb", str(args.llama_threads),
            "-cram", "0", "-ctxcp", "0", "--alias", "m"]))
    return base, systems, tokens, kv_bytes


def memory(args) -> dict:
    """Resident memory after a warm-up (each speed workload once, then the KV budget written
    through, then 3 s idle): radixserve from the GGUF (auto) and llama.cpp's server on the same
    file, holding the same KV bytes."""
    base, systems, tokens, kv_bytes = _systems(args, float32=False)
    out: dict[str, dict[str, float]] = {}
    for label, command in systems:
        with serving(command) as (url, process):
            for workload in WORKLOADS:
                asyncio.run(_warm(url, workload, args))
            asyncio.run(_fill_kv(url, tokens))
            time.sleep(IDLE_BEFORE_MEMORY_S)
            out[label] = resident_mib(process.pid)
            print(f"  memory: {label}: {out[label]['rss_mib']:.1f} MiB resident", flush=True)
    return {"model": args.model, "base": base, "kv_bytes": kv_bytes, "memory": out}


async def _warm(url: str, workload: str, args) -> None:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        await _once(client, url, workload, args, random.Random(len(workload)))


def print_memory(report: dict, target: float) -> None:
    memory, base = report["memory"], report["base"]
    print(f"memory: {report['model']} model, every server holding {report['kv_bytes'] / 2**20:.0f} MiB of float32 KV, "
          f"after each speed workload once and the KV written through")
    for label, m in memory.items():
        print(f"  {label:<24} RSS {m['rss_mib']:8.1f} MiB  (peak {m['peak_mib']:.1f})")
    llama = next((s for s in memory if s.startswith("llama.cpp")), None)
    if llama:
        ratio = memory[base]["rss_mib"] / memory[llama]["rss_mib"]
        print(f"  {base} / {llama}: {ratio:.3f}x (target <= {target}x) "
              f"{'[meets target]' if ratio <= target else '[BELOW target]'}")


def speed(args) -> dict:
    base, systems, tokens, kv_bytes = _systems(args, float32=True)
    rates: dict[str, dict[str, float]] = {w: {} for w in WORKLOADS}
    memory: dict[str, dict[str, float]] = {}
    for label, command in systems:
        with serving(command) as (url, process):
            print(f"  speed: {label} serving", flush=True)
            for workload in WORKLOADS:
                rates[workload][label] = asyncio.run(measure(url, workload, args))
                print(f"  speed: {label} {workload}: {rates[workload][label]:.1f} tokens/s", flush=True)
            asyncio.run(_fill_kv(url, tokens))
            time.sleep(IDLE_BEFORE_MEMORY_S)
            memory[label] = resident_mib(process.pid)
    return {"model": args.model, "base": base, "kv_tokens": tokens, "kv_bytes": kv_bytes,
            "new_tokens": args.new_tokens, "reps": args.reps,
            "rows": [{"workload": w, "rate": rates[w]} for w in WORKLOADS], "memory": memory}


async def measure(url: str, workload: str, args) -> float:
    """The workload's median tokens/s over --reps runs (one warm-up run first)."""
    results = []
    # no kept-alive connections: llama.cpp's server closed them under the client after a few requests
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for rep in range(args.reps + 1):
            rate = await _once(client, url, workload, args, random.Random(rep * 7919 + len(workload)))
            if rep:
                results.append(rate)
    return statistics.median(results)


async def _once(client, url: str, workload: str, args, rng: random.Random) -> float:
    """Decode: generated tokens per second of the streams, after each one's first token.
    Prompt: prompt tokens per second to the first token. Random token ids: no prefix is reused."""
    kind, size = workload.split()
    if kind == "prompt":
        prompt = [rng.randrange(100, 40000) for _ in range(int(size))]
        start = time.monotonic()
        record = await complete(client, "m", prompt, 1, workload, url)
        _check(record)
        return int(size) / (record.first - start)
    batch = int(size[1:])
    prompts = [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(batch)]
    records = await asyncio.gather(*(complete(client, "m", p, args.new_tokens, workload, url) for p in prompts))
    for r in records:
        _check(r)
    generated = sum(r.completion_tokens or len(r.chunks) for r in records) - batch
    return generated / (max(r.end for r in records) - max(r.first for r in records))


async def _fill_kv(url: str, tokens: int) -> None:
    """Unshared prompts that together fill every server's KV budget, so that resident memory
    compares pools written through (a pool only counts the pages it has touched), whatever
    the speed workloads happened to leave."""
    size = SLOT_TOKENS - 256
    rng = random.Random(4242)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for _ in range(-(-tokens // size)):
            _check(await complete(client, "m", [rng.randrange(100, 40000) for _ in range(size)], 1, "fill", url))


def _check(record) -> None:
    if record.error or record.first is None:
        raise SystemExit(f"a request failed: {record.error}")


def print_speed(report: dict, targets: dict) -> None:
    rows, memory = report["rows"], report["memory"]
    systems = list(rows[0]["rate"])
    print(f"speed: {report['model']} model, the same requests to each server in turn (median of {report['reps']} runs, "
          f"{report['new_tokens']} new tokens, EOS ignored), KV for {report['kv_tokens']} float32 tokens "
          f"({report['kv_bytes'] >> 20} MiB) each")
    print("  " + f"{'workload':<14}" + "".join(f"{s:>22}" for s in systems))
    for r in rows:
        print("  " + f"{r['workload']:<14}" + "".join(f"{r['rate'][s]:>16.1f} tok/s" for s in systems))
    print("  " + f"{'RSS MiB':<14}" + "".join(f"{memory[s]['rss_mib']:>22.0f}" for s in systems))
    print("  " + f"{'peak RSS MiB':<14}" + "".join(f"{memory[s]['peak_mib']:>22.0f}" for s in systems))
    base = report["base"]
    for other in [s for s in systems if s != base]:
        ratios = ", ".join(f"{r['workload']} {r['rate'][base] / r['rate'][other]:.2f}x" for r in rows)
        mem = memory[base]["rss_mib"] / memory[other]["rss_mib"]
        print(f"  {base} / {other}: {ratios}; resident memory {mem:.2f}x")
    llama = next((s for s in systems if s.startswith("llama.cpp")), None)
    if llama:
        by = {r["workload"]: r["rate"][base] / r["rate"][llama] for r in rows}
        checks = [("decode b1", by["decode b1"] >= targets["decode_b1"], f">= {targets['decode_b1']}x"),
                  ("decode b8", by["decode b8"] >= targets["decode_b8"], f">= {targets['decode_b8']}x"),
                  ("prompt", min(by["prompt 512"], by["prompt 2048"]) >= targets["prompt"], f">= {targets['prompt']}x"),
                  ("memory", memory[base]["rss_mib"] / memory[llama]["rss_mib"] <= targets["memory"],
                   f"<= {targets['memory']}x")]
        print("  targets against llama.cpp: " + "; ".join(
            f"{name} {want} {'[meets target]' if ok else '[BELOW target]'}" for name, ok, want in checks))
