"""Hybrid KV on Gemma 3 270M (five of every six layers attend to the last 512 tokens): what
the radix cache holds per cached token with window layers kept apart (hybrid_kv auto)
against every layer kept (hybrid_kv off), and an agent swarm against llama.cpp's server.

    python -m bench.bench_hybrid_kv [--quick] [--parts memory,swarm] [--swarm-workload short|long]
                                    [--systems hybrid,off,llama,llama-swa-full] [--json out.json] [--plot out.png]

memory  One conversation of real token ids (a synthetic tool agent: a system prompt, then
        turns that each append the model's greedy answer and a tool result), growing to
        ~4,096 tokens over 8 turns, run through an engine with hybrid_kv auto and one with
        hybrid_kv off, in the same kv_cache_memory, one after the other. After it: the bytes
        the cache holds per cached token, (blocks held * block_bytes + attached window pages
        * window_page_bytes) / cached tokens, for each and their ratio (target <= 0.3x); the
        tokens each pool holds in that memory (num_blocks * block_size) and their ratio; and
        the follow-up turns' cached tokens, which must be equal on both (a hybrid hit is
        exact, never cut short), as must the answers.
swarm   An agent swarm (bench_agents' agents: a shared tool prompt, own instructions, then
        turns of answer + tool result with seeded tool pauses; the same seeds, so the same
        arrivals, for every system) over HTTP with token-id prompts, one server at a time:
        radixserve hybrid (kv_cache_memory --hybrid-memory-share of the next one's),
        radixserve hybrid_kv off (enough memory for the whole working set), llama.cpp on the
        same GGUF with its defaults (-np slots = our max_num_seqs, its prompt cache in RAM)
        and with --swa-full. For each: reuse as a share of the ideal (what an unbounded cache
        could serve: the longest block-aligned prefix any earlier request computed; each
        request credited at most its ideal, since llama.cpp matches to the token), wall time,
        and KV memory: allocated (radixserve: pool blocks and window pages; llama.cpp: its
        KV buffers from its log, plus the most its prompt cache in RAM held) and the most held
        at once (radixserve, from /metrics). Targets (issue 46): >= 95% of ideal reuse, wall
        time <= 0.5x llama.cpp's default, at <= 0.4x the KV memory of full caching.
        --swarm-workload: short (the default; bench_agents' tool loop, each agent's history
        ~640 tokens, barely over the 512-token window) or long (coding agents whose
        conversations grow to ~4.5k tokens; why these sizes: LONG_SWARM in bench/lib/swarm.py).

Token ids are synthetic, greedy, EOS ignored. llama.cpp's KV is f16 (its default);
radixserve's float32: memory is also given as float32-equivalent token-layers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace

import httpx

from bench.lib.cli import bench_parser
from bench.lib.peers import add_llama_server
from bench.lib.servers import keyless_env, metrics, radixserve_command, resident_mib, served_process
from bench.lib.swarm import FULL_SWARM, LONG_SWARM, QUICK_SWARM, SWARMS, AgentSwarm, SwarmAgent, ideal_cached, remember

MODEL = "gemma3-270m"
BLOCK_SIZE = 16
MIB = 1 << 20


@dataclass(frozen=True)
class ModelGeometry:
    """What the swarm needs of a model: the name `radixserve serve --model` takes, the GGUF
    llama.cpp serves, and the KV shape (Gemma 3 270M: 18 layers, 15 of them sliding-window,
    one KV head of 256)."""

    name: str
    gguf: str
    layers: int
    window_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int

    @property
    def token_layer_bytes_f32(self) -> int:
        """K and V of one token in one layer, float32."""
        return 2 * self.kv_heads * self.head_dim * 4


def model_geometry(model: str) -> ModelGeometry:
    """`model`: gemma3-270m, or `default` (SmolLM2-135M from its own Q4_1 GGUF; no window layers)."""
    from radixserve.model.default_model import default_gguf_path
    from radixserve.model.hf_config import load_hf_config
    from radixserve.model.loader import resolve_model_path
    from radixserve.model.packaged_models import packaged_gguf
    from radixserve.model.spec import ModelSpec

    name = None if model == "default" else model
    spec = ModelSpec.from_hf_config(load_hf_config(resolve_model_path(name)))
    gguf = default_gguf_path() if name is None else packaged_gguf(name, None)
    return ModelGeometry(model, str(gguf), spec.num_layers, sum(1 for w in spec.layer_windows if w),
                         spec.num_kv_heads, spec.head_dim, spec.vocab_size)


# ---- part 1: memory held per cached token ---------------------------------------------------


@dataclass
class Conversation:
    turns: int
    system: int  # the first prompt's tokens
    step: int  # tokens each later turn adds besides the previous answer (tool result, user)
    answer: int
    seed: int = 0

    def describe(self) -> str:
        last = self.system + (self.turns - 1) * (self.answer + self.step) + self.answer
        return (f"one conversation, {self.turns} turns: a {self.system}-token first prompt, then each turn adds "
                f"the {self.answer}-token greedy answer and {self.step} new tokens; {last} tokens at the end")


FULL_CONVERSATION = Conversation(8, 600, 464, 32)  # 4,104 tokens at the end
QUICK_CONVERSATION = Conversation(4, 256, 240, 16)  # 1,040


@dataclass
class MemoryResult:
    system: str
    hybrid: bool
    num_blocks: int
    block_bytes: int
    window_pages: int
    window_page_bytes: int
    blocks_held: int
    pages_attached: int
    cached_tokens: int
    cache_nodes: int
    turn_cached: list[int]
    turn_prompt: list[int]
    answers: list[list[int]]
    wall_s: float
    last_window_pages: int = 0  # attached pages within the window before the conversation's end

    @property
    def bytes_held(self) -> int:
        return self.blocks_held * self.block_bytes + self.pages_attached * self.window_page_bytes

    @property
    def bytes_per_cached_token(self) -> float:
        return self.bytes_held / self.cached_tokens if self.cached_tokens else float("nan")

    @property
    def tokens_fit(self) -> int:
        return self.num_blocks * BLOCK_SIZE


def token_range(vocab_size: int) -> tuple[int, int]:
    """Plain tokens of the vocabulary: past the special ones at its start."""
    return (min(1000, vocab_size // 4), min(200_000, vocab_size))


def run_conversation(label: str, conversation: Conversation, engine_options: dict, progress: bool = True,
                     model: str = MODEL) -> MemoryResult:
    import gc

    from radixserve import Engine, SamplingParams

    start = time.monotonic()
    engine = Engine(model, **engine_options)
    low, high = token_range(engine.loaded.spec.vocab_size)
    rng = random.Random(conversation.seed)
    prompt = [rng.randrange(low, high) for _ in range(conversation.system)]
    params = SamplingParams(max_tokens=conversation.answer, temperature=0.0, ignore_eos=True)
    cached, prompts, answers = [], [], []
    for turn in range(conversation.turns):
        out = engine.generate([prompt], params, use_tqdm=False)[0]
        cached.append(out.cached_tokens)
        prompts.append(len(prompt))
        answers.append(list(out.token_ids))
        if progress:
            print(f"  [{label}] turn {turn + 1}/{conversation.turns}: prompt {len(prompt)} tokens, "
                  f"{out.cached_tokens} cached, {time.monotonic() - start:.0f} s", flush=True)
        final = prompt + list(out.token_ids)
        prompt = final + [rng.randrange(low, high) for _ in range(conversation.step)]
    engine.check_integrity()
    stats = engine.stats()
    pool = engine.runner.pool
    window = engine.pool.window
    result = MemoryResult(
        label, window is not None, stats["blocks_total"], pool.block_bytes,
        window.num_pages if window is not None else 0, pool.window_page_bytes,
        stats["blocks_total"] - stats["blocks_free"], window.num_attached if window is not None else 0,
        stats["blocks_cached"] * BLOCK_SIZE, stats["cache_nodes"], cached, prompts, answers,
        time.monotonic() - start)
    if window is not None:  # after the counts: a match marks the path used (and may split its last node)
        blocks = engine.cache.match_prefix(final).blocks
        last = blocks[window.first_needed(len(blocks) * BLOCK_SIZE):]
        result.last_window_pages = sum(window.has_page(b) for b in last)
    engine.close()
    del engine
    gc.collect()
    return result


def measure_memory(conversation: Conversation, kv_cache_memory: int, progress: bool = True,
                   model: str = MODEL) -> dict:
    base = dict(kv_cache_memory=kv_cache_memory, block_size=BLOCK_SIZE)
    hybrid = run_conversation("hybrid_kv auto", conversation, {**base, "hybrid_kv": "auto"}, progress, model)
    full = run_conversation("hybrid_kv off", conversation, {**base, "hybrid_kv": "off"}, progress, model)
    if not hybrid.hybrid:
        raise SystemExit(f"{model} has no window layers: hybrid_kv auto kept every layer")
    return {
        "model": model, "conversation": conversation.describe(), "kv_cache_memory": kv_cache_memory,
        "systems": [_memory_summary(r) for r in (hybrid, full)],
        "bytes_per_cached_token_ratio": hybrid.bytes_per_cached_token / full.bytes_per_cached_token,
        "tokens_fit_ratio": hybrid.tokens_fit / full.tokens_fit,
        "follow_up_cached_equal": hybrid.turn_cached == full.turn_cached,
        "answers_equal": hybrid.answers == full.answers,
        "last_window_only_ratio": (hybrid.blocks_held * hybrid.block_bytes
                                   + hybrid.last_window_pages * hybrid.window_page_bytes)
        / hybrid.cached_tokens / full.bytes_per_cached_token,
    }


def _memory_summary(r: MemoryResult) -> dict:
    return {"system": r.system, "num_blocks": r.num_blocks, "block_bytes": r.block_bytes,
            "window_pages": r.window_pages, "window_page_bytes": r.window_page_bytes, "blocks_held": r.blocks_held,
            "window_pages_attached": r.pages_attached, "cached_tokens": r.cached_tokens, "cache_nodes": r.cache_nodes,
            "bytes_held": r.bytes_held, "bytes_per_cached_token": r.bytes_per_cached_token,
            "tokens_fit": r.tokens_fit, "turn_prompt_tokens": r.turn_prompt, "turn_cached_tokens": r.turn_cached,
            "last_window_pages": r.last_window_pages, "wall_s": r.wall_s}


def print_memory(report: dict) -> None:
    hybrid, full = report["systems"]
    print(f"\nmemory: {report['model']}, {report['conversation']}; "
          f"kv_cache_memory {report['kv_cache_memory'] / MIB:.0f} MiB "
          f"for each engine (float32 KV, block {BLOCK_SIZE})")
    print(f"  {'':<16}{'blocks':>8}{'held':>7}{'win pages':>11}{'attached':>10}{'cached tok':>12}{'nodes':>7}"
          f"{'held MiB':>10}{'B / cached tok':>16}{'tokens fit':>12}")
    for r in (hybrid, full):
        pages = f"{r['window_pages']}" if r["window_pages"] else "-"
        attached = f"{r['window_pages_attached']}" if r["window_pages"] else "-"
        print(f"  {r['system']:<16}{r['num_blocks']:>8}{r['blocks_held']:>7}{pages:>11}{attached:>10}"
              f"{r['cached_tokens']:>12}{r['cache_nodes']:>7}{r['bytes_held'] / MIB:>10.1f}"
              f"{r['bytes_per_cached_token']:>16.0f}{r['tokens_fit']:>12}")
    print(f"  (block_bytes: hybrid {hybrid['block_bytes']} over the full layers, window_page_bytes "
          f"{hybrid['window_page_bytes']} over the window layers; off {full['block_bytes']}, all layers)")
    print(f"  turns' cached tokens: hybrid {hybrid['turn_cached_tokens']}, off {full['turn_cached_tokens']} -> "
          f"{'equal' if report['follow_up_cached_equal'] else 'DIFFERENT'}; answers "
          f"{'equal' if report['answers_equal'] else 'DIFFERENT'}")
    ratio = report["bytes_per_cached_token_ratio"]
    print(f"  bytes held per cached token, hybrid / off: {ratio:.3f}x (target <= 0.3x) "
          f"{'[meets target]' if ratio <= 0.3 else '[MISSES target]'}")
    print(f"  tokens that fit in the same memory, hybrid / off: {report['tokens_fit_ratio']:.2f}x "
          f"({hybrid['tokens_fit']} against {full['tokens_fit']})")
    print(f"  of hybrid's {hybrid['window_pages_attached']} attached window pages, {hybrid['last_window_pages']} lie "
          f"in the window before the conversation's end; the rest keep the windows before the "
          f"{hybrid['cache_nodes'] - 1} earlier node ends (each turn's cached prefix ends at a node). "
          f"Were only the last window kept: "
          f"{report['last_window_only_ratio']:.3f}x off's bytes per cached token (derived from these counts)")


# ---- part 2: an agent swarm against llama.cpp -------------------------------------------------




@dataclass
class SwarmResult:
    name: str
    wall_s: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    credited: int = 0  # cached tokens up to each request's ideal
    ideal_cached: int = 0
    errors: list[str] = field(default_factory=list)
    kv_allocated_bytes: int = 0
    kv_allocated_token_layers: int = 0  # cells x layers: float32-equivalent = this * token_layer_bytes_f32
    token_layer_bytes_f32: int = 0  # the model's (ModelGeometry)
    kv_peak_held_bytes: int | None = None
    prompt_cache_peak_bytes: int | None = None  # llama.cpp: its prompt cache in RAM
    notes: str = ""

    @property
    def reuse_of_ideal(self) -> float:
        return self.credited / self.ideal_cached if self.ideal_cached else 0.0

    @property
    def kv_memory_f32_bytes(self) -> int:
        """The KV allocated, as float32 bytes of its token-layers (llama.cpp's are f16)."""
        return self.kv_allocated_token_layers * self.token_layer_bytes_f32


async def _swarm(name: str, url: str, workload: AgentSwarm, llama: bool, progress: bool,
                 vocab_size: int) -> SwarmResult:
    low, high = token_range(vocab_size)
    rng = random.Random(workload.seed)
    tool_prompt = [rng.randrange(low, high) for _ in range(workload.tool_prompt)]
    agents = [SwarmAgent(i, workload, tool_prompt, low, high) for i in range(workload.agents)]
    seen: set[int] = set()
    result = SwarmResult(name)
    total = workload.agents * workload.turns
    begin = time.monotonic()
    # no kept-alive connections: llama.cpp's server drops them after a few requests
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:

        async def one(prompt: list[int]) -> tuple[list[int], int]:
            if llama:
                body = {"prompt": prompt, "n_predict": workload.answer, "temperature": 0.0, "ignore_eos": True,
                        "cache_prompt": True, "return_tokens": True}
                answer = await client.post("/completion", json=body)
                answer.raise_for_status()
                data = answer.json()
                return list(data["tokens"]), int(data["timings"]["cache_n"])
            body = {"model": "m", "prompt": prompt, "max_tokens": workload.answer, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            answer = await client.post("/v1/completions", json=body)
            answer.raise_for_status()
            data = answer.json()
            return list(data["choices"][0]["token_ids"]), int(data["usage"]["prompt_tokens_details"]["cached_tokens"])

        async def run(agent: SwarmAgent) -> None:
            await asyncio.sleep(agent.start)
            for _ in range(workload.turns):
                prompt = list(agent.context)
                ideal = ideal_cached(prompt, seen)
                remember(prompt[:-1], seen)
                try:
                    answer, cached = await one(prompt)
                except httpx.HTTPError as exc:
                    result.errors.append(f"agent {agent.index}: {type(exc).__name__}: {exc}")
                    return
                remember((prompt + answer)[:-1], seen)
                result.requests += 1
                result.prompt_tokens += len(prompt)
                result.cached_tokens += cached
                result.credited += min(cached, ideal)
                result.ideal_cached += ideal
                if progress and (result.requests % max(1, total // 8) == 0 or result.requests == total):
                    print(f"  [{name}] {result.requests}/{total} requests, {time.monotonic() - begin:.0f} s",
                          flush=True)
                agent.context = prompt + answer + agent.tokens(workload.tool_result)
                await asyncio.sleep(agent.rng.uniform(*workload.latency))

        await asyncio.gather(*(run(a) for a in agents))
    result.wall_s = time.monotonic() - begin
    return result


class _PeakHeld(threading.Thread):
    """Polls a radixserve server's /metrics for the KV bytes held (blocks used, window pages attached)."""

    def __init__(self, url: str, block_bytes: int, page_bytes: int):
        super().__init__(daemon=True)
        self.url, self.block_bytes, self.page_bytes = url, block_bytes, page_bytes
        self.peak = 0
        self.done = threading.Event()

    def sample(self) -> None:
        m = metrics(self.url)
        held = int(m.get("radixserve_kv_blocks_used", 0)) * self.block_bytes
        held += int(m.get("radixserve_kv_window_pages_attached", 0)) * self.page_bytes
        self.peak = max(self.peak, held)

    def run(self) -> None:
        while not self.done.wait(0.5):
            with contextlib.suppress(Exception):
                self.sample()


def _served(command: list[str], log):
    return served_process(command, keyless_env(), stdout=log, stderr=subprocess.STDOUT)


def run_radixserve(name: str, workload: AgentSwarm, kv_bytes: int, hybrid: bool, max_num_seqs: int,
                   progress: bool, window_pages_ratio: float | None = None,
                   geometry: ModelGeometry | None = None, serve_args: str = "") -> SwarmResult:
    geometry = geometry or model_geometry(MODEL)
    command = radixserve_command("--kv-cache-memory", str(kv_bytes), "--block-size", str(BLOCK_SIZE),
                                 "--hybrid-kv", "auto" if hybrid else "off", "--max-num-seqs", str(max_num_seqs))
    command += [] if geometry.name == "default" else ["--model", geometry.name]
    layers, window_layers, token_layer = geometry.layers, geometry.window_layers, geometry.token_layer_bytes_f32
    if hybrid and window_pages_ratio is not None:
        command += ["--window-pages-ratio", str(window_pages_ratio)]
    command += shlex.split(serve_args)
    with tempfile.TemporaryFile() as log:
        try:
            with _served(command, log) as (url, _):
                m = metrics(url)
                blocks, pages = int(m["radixserve_kv_blocks_total"]), int(m.get("radixserve_kv_window_pages_total", 0))
                full_layers = layers - window_layers if pages else layers
                block_bytes = BLOCK_SIZE * full_layers * token_layer
                page_bytes = BLOCK_SIZE * window_layers * token_layer if pages else 0
                if m.get("radixserve_kv_bytes_per_token") != full_layers * token_layer:
                    raise SystemExit(f"{name}: the server's KV bytes per token "
                                     f"{m.get('radixserve_kv_bytes_per_token')} are not {full_layers} float32 layers'")
                httpx.post(url + "/v1/completions", json={"model": "m", "prompt": [2000 + i for i in range(24)],
                                                          "max_tokens": 2}, timeout=600).raise_for_status()
                httpx.post(url + "/flush_cache", timeout=60)  # the warm-up leaves nothing cached
                poller = _PeakHeld(url, block_bytes, page_bytes)
                poller.start()
                result = asyncio.run(_swarm(name, url, workload, False, progress, geometry.vocab_size))
                poller.done.set()
                poller.join()
                poller.sample()
                result.kv_allocated_bytes = blocks * block_bytes + pages * page_bytes
                result.kv_allocated_token_layers = BLOCK_SIZE * (blocks * full_layers + pages * window_layers)
                result.token_layer_bytes_f32 = token_layer
                result.kv_peak_held_bytes = poller.peak
                m = metrics(url)
                result.notes = (f"{blocks} blocks" + (f" + {pages} window pages" if pages else "")
                                + f"; {int(m.get('radixserve_evicted_blocks_total', 0))} blocks evicted, "
                                f"{int(m.get('radixserve_preemptions_total', 0))} preemptions"
                                + (f", {int(m.get('radixserve_kv_window_pages_trimmed_total', 0))} window pages trimmed"
                                   if pages else ""))
                return result
        except BaseException:
            log.seek(0)
            print(f"{name}: its log ends:\n" + log.read()[-3000:].decode(errors="replace"), file=sys.stderr)
            raise


# "llama_kv_cache: size =   24.00 MiB (  2048 cells,   3 layers,  4/4 seqs), K (f16): ..., V (f16): ..."
# (cells per sequence stream; the MiB cover them all)
_KV_SIZE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers.*K \((\w+)\)")
_TYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32}
_CACHE_STATE = re.compile(r"cache state: (\d+) prompts, ([\d.]+) MiB")


def run_llama(name: str, workload: AgentSwarm, server: str, slots: int, slot_tokens: int, threads: int,
              swa_full: bool, progress: bool, geometry: ModelGeometry | None = None) -> SwarmResult:
    geometry = geometry or model_geometry(MODEL)
    command = [server, "-m", geometry.gguf, "--host", "127.0.0.1", "-c", str(slots * slot_tokens), "-np", str(slots),
               "-t", str(threads), "-tb", str(threads), "--alias", "m", "-lv", "4"]  # -lv 4: KV sizes, prompt cache
    command += ["--swa-full"] if swa_full else []
    with tempfile.NamedTemporaryFile("w+b") as log:
        try:
            with _served(command, log) as (url, process):
                httpx.post(url + "/completion", json={"prompt": [2000 + i for i in range(24)], "n_predict": 2,
                                                      "cache_prompt": False}, timeout=600).raise_for_status()
                result = asyncio.run(_swarm(name, url, workload, True, progress, geometry.vocab_size))
                rss = resident_mib(process.pid)["rss_mib"]
        except BaseException:
            log.seek(0)
            print(f"{name}: its log ends:\n" + log.read()[-3000:].decode(errors="replace"), file=sys.stderr)
            raise
        log.seek(0)
        text = log.read().decode(errors="replace")
    sizes = [(float(m), int(c), int(layers), kind) for m, c, layers, kind in _KV_SIZE.findall(text)]
    result.kv_allocated_bytes = int(sum(m for m, _, _, _ in sizes) * MIB)
    cell_layer = 2 * geometry.kv_heads * geometry.head_dim  # K and V elements of one token in one layer
    result.kv_allocated_token_layers = int(sum(m * MIB / (cell_layer * _TYPE_BYTES.get(kind, 2))
                                               for m, _, _, kind in sizes))
    result.token_layer_bytes_f32 = geometry.token_layer_bytes_f32
    states = [float(m) for _, m in _CACHE_STATE.findall(text)]
    result.prompt_cache_peak_bytes = int(max(states, default=0.0) * MIB)
    result.notes = ("KV " + " + ".join(f"{m:.0f} MiB ({c} cells a stream x {layers} layers, {kind})"
                                       for m, c, layers, kind in sizes)
                    + f"; -c {slots * slot_tokens} -np {slots}; RSS {rss:.0f} MiB; its log {text.count(chr(10))} lines")
    if not sizes:
        result.notes += "; no KV size line found in its log"
    return result


def measure_swarm(workload: AgentSwarm, systems: list[str], args, geometry: ModelGeometry | None = None) -> dict:
    geometry = geometry or model_geometry(MODEL)
    per_agent = workload.instructions + workload.turns * (workload.answer + workload.tool_result)
    longest = workload.tool_prompt + per_agent + 64
    token_bytes = geometry.layers * geometry.token_layer_bytes_f32
    full_kv = max(int(1.25 * workload.working_set_tokens()) * token_bytes, 2 * longest * token_bytes)
    windowed = geometry.window_layers > 0
    slot_tokens = -(-longest // 256) * 256
    results = []
    off_label = "radixserve hybrid_kv off" if windowed else "radixserve"
    for key in systems:
        print(f"running {key} ...", flush=True)
        if key in ("hybrid", "hybrid-same", "llama-swa-full") and not windowed:
            print(f"  skipped: {geometry.name} has no sliding-window layers")
            continue
        if key == "hybrid":
            kv = int(args.hybrid_memory_share * full_kv)
            label = f"radixserve hybrid ({args.hybrid_memory_share:g}x memory)"
            results.append(run_radixserve(label, workload, kv, True, args.max_num_seqs, not args.quiet,
                                          args.window_pages_ratio, geometry, args.serve_args))
        elif key == "hybrid-same":
            results.append(run_radixserve("radixserve hybrid (1x memory)", workload, full_kv, True, args.max_num_seqs,
                                          not args.quiet, args.window_pages_ratio, geometry, args.serve_args))
        elif key == "off":
            results.append(run_radixserve(off_label, workload, full_kv, False, args.max_num_seqs, not args.quiet,
                                          geometry=geometry, serve_args=args.serve_args))
        elif key in ("llama", "llama-swa-full"):
            if not args.llama_server or not os.path.exists(args.llama_server):
                print(f"  skipped: no llama-server at {args.llama_server}" if args.llama_server
                      else "  skipped: no llama-server given (--llama-server or LLAMA_SERVER)")
                continue
            label = "llama.cpp --swa-full" if key == "llama-swa-full" else "llama.cpp default"
            results.append(run_llama(label, workload, args.llama_server, args.max_num_seqs, slot_tokens,
                                     args.llama_threads, key == "llama-swa-full", not args.quiet, geometry))
        else:
            raise SystemExit(f"unknown system {key!r}")
    report = {"model": geometry.name, "workload": workload.describe(), "working_set_tokens": workload.working_set_tokens(),
              "full_kv_bytes": full_kv, "max_num_seqs": args.max_num_seqs, "slot_tokens": slot_tokens,
              "systems": [{**asdict(r), "reuse_of_ideal": r.reuse_of_ideal,
                           "kv_memory_f32_bytes": r.kv_memory_f32_bytes} for r in results]}
    by = {r.name.split(" (")[0]: r for r in results}
    hybrid, off = by.get("radixserve hybrid"), by.get(off_label)
    llama, swa_full = by.get("llama.cpp default"), by.get("llama.cpp --swa-full")
    ratios = {}
    if off and llama:
        ratios["off_wall_vs_llama_default"] = off.wall_s / llama.wall_s
    if hybrid and llama:
        ratios["wall_vs_llama_default"] = hybrid.wall_s / llama.wall_s
        ratios["kv_f32_vs_llama_default"] = hybrid.kv_memory_f32_bytes / llama.kv_memory_f32_bytes
    if hybrid and swa_full:
        ratios["wall_vs_llama_swa_full"] = hybrid.wall_s / swa_full.wall_s
        ratios["kv_f32_vs_llama_swa_full"] = hybrid.kv_memory_f32_bytes / swa_full.kv_memory_f32_bytes
    if hybrid and off:
        ratios["kv_allocated_vs_off"] = hybrid.kv_allocated_bytes / off.kv_allocated_bytes
        ratios["kv_peak_held_vs_off"] = hybrid.kv_peak_held_bytes / max(1, off.kv_peak_held_bytes)
        ratios["wall_vs_off"] = hybrid.wall_s / off.wall_s
    report["ratios"] = ratios
    return report


def print_swarm(report: dict) -> None:
    print(f"\nswarm ({report.get('workload_name', 'short')}): {report.get('model', MODEL)} over HTTP (token-id prompts, greedy, EOS "
          f"ignored): {report['workload']}; "
          f"working set {report['working_set_tokens']} tokens; max_num_seqs / -np {report['max_num_seqs']}, "
          f"llama.cpp {report['slot_tokens']} tokens a slot")
    print(f"  {'system':<36}{'wall s':>8}{'reqs':>6}{'prompt':>8}{'cached':>8}{'ideal':>8}{'of ideal':>10}"
          f"{'KV alloc MiB':>14}{'as f32 MiB':>12}{'peak held MiB':>15}{'prompt cache MiB':>18}")
    for r in report["systems"]:
        peak = f"{r['kv_peak_held_bytes'] / MIB:.1f}" if r["kv_peak_held_bytes"] is not None else "-"
        cache = f"{r['prompt_cache_peak_bytes'] / MIB:.1f}" if r["prompt_cache_peak_bytes"] is not None else "-"
        print(f"  {r['name']:<36}{r['wall_s']:>8.1f}{r['requests']:>6}{r['prompt_tokens']:>8}{r['cached_tokens']:>8}"
              f"{r['ideal_cached']:>8}{r['reuse_of_ideal']:>10.1%}{r['kv_allocated_bytes'] / MIB:>14.1f}"
              f"{r['kv_memory_f32_bytes'] / MIB:>12.1f}{peak:>15}{cache:>18}")
    for r in report["systems"]:
        print(f"  {r['name']}: {r['notes']}")
        for e in r["errors"][:3]:
            print(f"    error: {e}")
    print("  (of ideal: cached tokens, each request credited up to its block-aligned ideal; KV alloc: the KV the "
          "server allocated, in its own dtype; as f32: the same token-layers at float32; peak held: the most "
          "radixserve's cache and requests held at once (/metrics, every 0.5 s); prompt cache: the most "
          "llama.cpp's prompt cache in RAM held, f16 slot states, beside its KV)")
    ratios = report["ratios"]
    hybrid = next((r for r in report["systems"] if r["name"].startswith("radixserve hybrid (")), None)
    if hybrid:
        print(f"  radixserve hybrid: {hybrid['reuse_of_ideal']:.1%} of ideal reuse (target >= 95%) "
              f"{'[meets target]' if hybrid['reuse_of_ideal'] >= 0.95 else '[MISSES target]'}")
    if "wall_vs_llama_default" in ratios:
        v = ratios["wall_vs_llama_default"]
        print(f"  wall time, radixserve hybrid / llama.cpp default: {v:.2f}x (target <= 0.5x) "
              f"{'[meets target]' if v <= 0.5 else '[MISSES target]'}")
    if "off_wall_vs_llama_default" in ratios:
        print(f"  wall time, radixserve with every layer's KV kept / llama.cpp default: "
              f"{ratios['off_wall_vs_llama_default']:.2f}x")
    if "wall_vs_llama_swa_full" in ratios:
        print(f"  wall time, radixserve hybrid / llama.cpp --swa-full: {ratios['wall_vs_llama_swa_full']:.2f}x")
    if "kv_allocated_vs_off" in ratios:
        v = ratios["kv_allocated_vs_off"]
        print(f"  KV memory, radixserve hybrid / radixserve off (full caching): allocated {v:.2f}x (target <= 0.4x) "
              f"{'[meets target]' if v <= 0.4 + 1e-9 else '[MISSES target]'}, most held at once "
              f"{ratios['kv_peak_held_vs_off']:.2f}x; wall time {ratios['wall_vs_off']:.2f}x")
    for key, other in (("kv_f32_vs_llama_default", "llama.cpp default"), ("kv_f32_vs_llama_swa_full",
                                                                           "llama.cpp --swa-full")):
        if key in ratios:
            print(f"  KV allocated as float32, radixserve hybrid / {other}: {ratios[key]:.2f}x")


# ---- main -------------------------------------------------------------------------------------


def main() -> None:
    parser = bench_parser(__doc__, quick=f"memory: {QUICK_CONVERSATION.describe()}; swarm: {QUICK_SWARM.describe()}",
                          json_help="write the report here (JSON), after each part",
                          plot="write a chart of the parts run here (PNG)")
    parser.add_argument("--parts", default="memory,swarm", help="which parts, run in the order given")
    parser.add_argument("--kv-cache-memory", type=int, default=None,
                        help="memory part: bytes for each engine (default 256 MiB, 64 MiB with --quick)")
    parser.add_argument("--model", default=MODEL,
                        help="swarm: gemma3-270m, or default (SmolLM2-135M from its Q4_1 GGUF: no window layers, so "
                             "only the systems off and llama run); the memory part is gemma3-270m's")
    parser.add_argument("--swarm-workload", choices=sorted(SWARMS), default="short",
                        help=f"swarm: short ({FULL_SWARM.describe()}) or long, coding agents "
                             f"({LONG_SWARM.describe()})")
    parser.add_argument("--systems", default="hybrid,off,llama,llama-swa-full",
                        help="swarm systems among hybrid, hybrid-same (1x memory), off, llama, llama-swa-full")
    parser.add_argument("--hybrid-memory-share", type=float, default=0.4,
                        help="swarm: radixserve hybrid's kv_cache_memory as a share of the full-caching systems'")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="swarm: radixserve's max_num_seqs, llama.cpp's -np")
    parser.add_argument("--window-pages-ratio", type=float, default=None,
                        help="swarm: radixserve hybrid's --window-pages-ratio (default: the engine's)")
    parser.add_argument("--serve-args", default="", help="swarm: more arguments for every `radixserve serve`, one "
                        "string (e.g. --serve-args='--step-trace /tmp/steps.jsonl')")
    parser.add_argument("--agents", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    add_llama_server(parser)
    parser.add_argument("--llama-threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    report: dict = {"model": MODEL, "quick": args.quick}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"bench_hybrid_kv ({started}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")
    for part in parts:  # in the order given
        if part == "memory":
            conversation = QUICK_CONVERSATION if args.quick else FULL_CONVERSATION
            memory = args.kv_cache_memory or ((64 if args.quick else 256) * MIB)
            print(f"\nmemory: {conversation.describe()}", flush=True)
            report["memory"] = measure_memory(conversation, memory, not args.quiet)
            print_memory(report["memory"])
        elif part == "swarm":
            full, quick = SWARMS[args.swarm_workload]
            workload = replace(quick if args.quick else full)
            for name in ("agents", "turns"):
                if getattr(args, name) is not None:
                    setattr(workload, name, getattr(args, name))
            print(f"\nswarm: {workload.describe()}", flush=True)
            report["swarm"] = measure_swarm(workload, [s.strip() for s in args.systems.split(",") if s.strip()], args,
                                            model_geometry(args.model))
            report["swarm"]["workload_name"] = args.swarm_workload
            print_swarm(report["swarm"])
        else:
            raise SystemExit(f"unknown part {part!r} (memory, swarm)")
        _write_json(args.json, report)
    if args.json:
        print(f"\njson: {args.json}")
    if args.plot:
        _plot(args.plot, report)


def _write_json(path: str | None, report: dict) -> None:
    """After each part: a run cut short keeps what it measured."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def _plot(path: str, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if "memory" in report:
        systems = report["memory"]["systems"]
        panels.append(("bytes held per cached token", [s["system"] for s in systems],
                       [s["bytes_per_cached_token"] for s in systems]))
        panels.append(("tokens that fit (same memory)", [s["system"] for s in systems],
                       [s["tokens_fit"] for s in systems]))
    if "swarm" in report:
        systems = report["swarm"]["systems"]
        names = [s["name"] for s in systems]
        panels.append(("swarm: reuse, share of ideal", names, [s["reuse_of_ideal"] for s in systems]))
        panels.append(("swarm: wall time (s)", names, [s["wall_s"] for s in systems]))
        panels.append(("swarm: KV memory as float32 (MiB)", names, [s["kv_memory_f32_bytes"] / MIB for s in systems]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4.5), squeeze=False)
    for ax, (title, names, values) in zip(axes[0], panels):
        ax.bar(range(len(values)), values)
        ax.set_xticks(range(len(values)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"hybrid KV on {report.get('swarm', {}).get('model', MODEL)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
