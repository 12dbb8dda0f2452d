"""An agent swarm under memory pressure: today's LRU prefix cache, + a second KV tier,
+ tier and sessions, and the cache off, in one run on the default model; `--systems lru,int8`
compares LRU on float32 KV with LRU on int8 pages in the same bytes (--kv-cache-dtype int8).

    python -m bench.bench_agents [--quick] [--agents 32 --turns 6 ...] [--plot agents.png]
                                 [--json agents.json] [--measure-tier] [--measure-prefetch]

Every agent sends `turns` requests. Turn t's prompt is the shared tool prompt, the agent's
own instructions and its whole history: every earlier answer (generated token ids, kept
byte-stable) and tool result. Between an answer and its next request the agent waits a
simulated tool latency (uniform in [min, max] seconds, seeded). The KV pool holds about a
third of the working set (the tool prompt once plus every agent's final context), so
paused agents' contexts are evicted while they wait.

The smalltier systems (`--systems smalltier,smalltier+sessions`) give the second tier only
`--tier-share` of the working set, so entries leave the tier too and the order matters:
LRU, or sessions' (an agent's latest context kept, a superseded branch first out, a
finished agent's session closed). `--retry-share P` retries a tool call with chance P,
which supersedes the context the answer followed (e.g. `--quick --systems
lru,smalltier,smalltier+sessions --retry-share 0.3`).

For each system it reports prompt tokens computed, reuse as a share of the ideal (what
an unbounded cache could serve: the longest block-aligned prefix any earlier request
computed), wall time and TTFT p50/p95. `--measure-tier` first measures restoring 1,000
tokens of KV from each tier medium against recomputing them (ms per 1,000 tokens);
`--measure-prefetch` measures restores from a cold tier file (its pages dropped from
memory) with and without the prefetch thread, and writes to fresh slots, then exits.
Token ids are synthetic (no tokenizer), greedy, EOS ignored.
"""

from __future__ import annotations

import gc
import os
import random
import tempfile
import time
from dataclasses import dataclass, field

from bench.lib.cli import bench_parser, write_json
from bench.lib.swarm import BLOCK_SIZE, AgentSwarm, ideal_cached, remember

VOCAB_LOW, VOCAB_HIGH = 200, 40000  # plain tokens of the default model's vocabulary


FULL = AgentSwarm(32, 6, 1536, 64, 160, 32, (0.5, 3.0))
QUICK = AgentSwarm(8, 3, 128, 64, 96, 8, (0.3, 1.0))


@dataclass
class SystemResult:
    name: str
    wall_s: float
    prompt_tokens: int
    computed_prompt_tokens: int
    cached_tokens: int
    restored_tokens: int
    ideal_cached: int
    ttfts: list[float] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    @property
    def reuse_of_ideal(self) -> float:
        return self.cached_tokens / self.ideal_cached if self.ideal_cached else 0.0

    def ttft(self, q: float) -> float:
        xs = sorted(self.ttfts)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Agent:
    def __init__(self, index: int, workload: AgentSwarm, tool_prompt: list[int], rng: random.Random):
        self.index = index
        self.rng = rng
        self.workload = workload
        self.context = tool_prompt + _tokens(rng, workload.instructions)
        self.before_result = 0  # where the last tool result begins in the context (0: none yet)
        self.turn = 0
        self.ready_at = 0.0

    def next_prompt(self) -> list[int]:
        return list(self.context)

    def answered(self, answer: list[int], now: float) -> None:
        """The answer joins the history, the tool runs, its result joins too. A retry (with
        chance retry_share): the previous tool call failed, so its result and this answer
        are dropped and the retried call's result takes their place; the context this
        answer extended is superseded (a session demotes it)."""
        self.turn += 1
        retry = self.workload.retry_share > 0 and self.rng.random() < self.workload.retry_share
        if retry and self.before_result:
            self.context = self.context[:self.before_result]
        else:
            self.context += answer
            self.before_result = len(self.context)
        self.context += _tokens(self.rng, self.workload.tool_result)
        low, high = self.workload.latency
        self.ready_at = now + self.rng.uniform(low, high)


def run_system(name: str, workload: AgentSwarm, engine_options: dict, use_sessions: bool, progress: bool) -> SystemResult:
    from radixserve import Engine, SamplingParams

    engine = Engine(**engine_options)
    engine.generate([[VOCAB_LOW + 1] * 20], SamplingParams(max_tokens=1))  # untimed warm-up
    engine.flush_cache()
    rng = random.Random(workload.seed)
    tool_prompt = _tokens(rng, workload.tool_prompt)
    agents = [Agent(i, workload, tool_prompt, random.Random(workload.seed * 1000 + i)) for i in range(workload.agents)]
    params = SamplingParams(max_tokens=workload.answer, temperature=0.0, ignore_eos=True)
    seen: set[int] = set()  # block hashes any earlier request computed: the ideal cache
    result = SystemResult(name, 0.0, 0, 0, 0, 0, 0)
    owner: dict[str, Agent] = {}
    total = workload.agents * workload.turns
    done = 0
    start = time.monotonic()
    while done < total:
        now = time.monotonic() - start
        for agent in agents:
            if agent.turn < workload.turns and agent.ready_at <= now and agent not in owner.values():
                prompt = agent.next_prompt()
                result.ideal_cached += ideal_cached(prompt, seen)
                remember(prompt[:-1], seen)  # later requests may share it once it is computed
                session = f"agent-{agent.index}" if use_sessions else None
                owner[engine.add_request(prompt, params, session_id=session)] = agent
        if not engine.has_unfinished_requests():
            time.sleep(0.01)
            continue
        for out in engine.step():
            if not out.finished:
                continue
            agent = owner.pop(out.request_id)
            remember((out.prompt_token_ids + out.token_ids)[:-1], seen)  # the last token is never computed
            result.prompt_tokens += out.prompt_tokens
            result.cached_tokens += out.cached_tokens
            result.restored_tokens += out.restored_tokens
            result.computed_prompt_tokens += out.prompt_tokens - out.cached_tokens
            result.ttfts.append(out.metrics.get("ttft_s", float("nan")))
            agent.answered(list(out.token_ids), time.monotonic() - start)
            if use_sessions and agent.turn == workload.turns:
                engine.close_session(f"agent-{agent.index}")  # the agent is done: its context is ordinary
            done += 1
            if progress and (done % max(1, total // 10) == 0 or done == total):
                print(f"  [{name}] {done}/{total} requests, {time.monotonic() - start:.0f} s", flush=True)
    result.wall_s = time.monotonic() - start
    engine.check_integrity()
    result.stats = engine.stats()
    engine.close()
    del engine
    gc.collect()
    return result


def measure_tier(tokens: int = 1000) -> dict[str, float]:
    """ms to bring `tokens` tokens of KV into the pool from each medium, and to recompute them."""
    import zlib

    import torch

    from radixserve import Engine, SamplingParams
    from radixserve.attention.kv_pool import KVPool
    from radixserve.kv_tier.index import KVCopy
    from radixserve.kv_tier.store import TierStore

    engine = Engine(num_kv_blocks=256)
    spec = engine.loaded.spec
    n = -(-tokens // BLOCK_SIZE)
    pool = KVPool(spec.num_layers, 2 * n, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, torch.float32, torch.device("cpu"))
    pool.kv.normal_()
    shape = pool.block_shape()
    out = {}
    ids = [(7 * i) % (VOCAB_HIGH - VOCAB_LOW) + VOCAB_LOW for i in range(tokens)]
    engine.generate([ids[:32]], SamplingParams(max_tokens=1))
    t = time.perf_counter()
    engine.generate([ids], SamplingParams(max_tokens=1))
    out["recompute (prefill)"] = (time.perf_counter() - t) * 1000 * 1000 / tokens
    saves = [KVCopy(True, b, b) for b in range(n)]
    restores = [KVCopy(False, n + b, b) for b in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        for label, directory in (("RAM tier (anonymous memory)", None), ("disk tier (mmap file, page cache)", tmp)):
            store = TierStore(n, shape, torch.float32, directory)
            store.run(pool, saves)
            t = time.perf_counter()
            store.run(pool, restores)
            out[label] = (time.perf_counter() - t) * 1000 * 1000 / tokens
            if directory is not None:
                out["disk tier, cold (file read after dropping it from the page cache)"] = _cold_read_ms(
                    store, pool, n, tmp) * 1000 / tokens
            store.close()
    raw = pool.kv[:, :, :n].contiguous().numpy().tobytes()
    packed = zlib.compress(raw, 1)
    t = time.perf_counter()
    restored = zlib.decompress(packed)
    pool.kv[:, :, n:2 * n].copy_(torch.frombuffer(bytearray(restored), dtype=torch.float32).view(pool.kv[:, :, :n].shape))
    out[f"compressed RAM tier (zlib-1, ratio {len(raw) / len(packed):.2f})"] = (time.perf_counter() - t) * 1000 * 1000 / tokens
    engine.close()
    return out


def measure_prefetch(tokens: int = 1000, reps: int = 5) -> dict[str, float]:
    """A prefix of `tokens` tokens restored from a file-backed tier, in the engine: ms of the
    engine thread's step that restores it (scheduling and copies, per 1,000 tokens) and
    time to first token, median of `reps`: pages in memory, pages dropped from memory
    without the prefetch thread, and dropped with it (the request is held while they are
    read in). Then ms per 1,000 tokens of writing blocks to fresh tier slots, without and
    with the slots faulted in ahead by the prefetch thread."""
    import statistics

    import torch

    from radixserve import Engine, SamplingParams
    from radixserve.attention.kv_pool import KVPool
    from radixserve.kv_tier.index import KVCopy, KVTier
    from radixserve.kv_tier.prefetch import TierPrefetcher
    from radixserve.kv_tier.store import TierStore

    ids = [(13 * i) % (VOCAB_HIGH - VOCAB_LOW) + VOCAB_LOW for i in range(tokens + 1)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    modes = ("pages in memory", "pages on disk, no prefetch", "pages on disk, prefetch")
    samples: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(num_kv_blocks=2 * tokens // BLOCK_SIZE + 8, block_size=BLOCK_SIZE, kv_offload_dir=tmp,
                        kv_offload_memory=512 << 20, max_num_batched_tokens=2048, chunked_prefill_size=2048)
        reference = engine.generate([ids], params)[0].token_ids
        prefetch = engine.tiering.prefetch
        for _ in range(reps):
            for mode in modes:
                engine.cache.evict(engine.cache.num_evictable_blocks)
                engine.step()  # an empty step runs the copies to the tier
                if mode != modes[0] and engine.tiering.drop_cached_pages():
                    raise RuntimeError("the tier file's pages stay in memory on this filesystem")
                engine.tiering.prefetch = None if mode == modes[1] else prefetch
                rid = engine.add_request(ids, params)
                final = None
                while final is None:
                    final = next((o for o in engine.step() if o.request_id == rid and o.finished), None)
                restore_ms = engine.last_step_timings["schedule_s"] * 1000
                if final.restored_tokens < tokens - BLOCK_SIZE or final.token_ids != reference:
                    raise RuntimeError(f"{mode}: restored {final.restored_tokens} tokens, same output: "
                                       f"{final.token_ids == reference}")
                samples[mode].append((restore_ms * 1000 / final.restored_tokens, final.metrics["ttft_s"] * 1000))
        engine.tiering.prefetch = prefetch
        for mode in modes:
            out[f"restore, {mode}: engine-thread ms per 1,000 tokens"] = statistics.median(a for a, _ in samples[mode])
            out[f"restore, {mode}: TTFT ms"] = statistics.median(b for _, b in samples[mode])
        engine.check_integrity()
        engine.close()
        spec = engine.loaded.spec
        n = -(-tokens // BLOCK_SIZE)
        pool = KVPool(spec.num_layers, n, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, torch.float32, torch.device("cpu"))
        pool.kv.normal_()
        for label, warm in (("write to fresh tier slots, not faulted in", False),
                            ("write to fresh tier slots, faulted in ahead", True)):
            times = []
            for rep in range(reps):
                directory = os.path.join(tmp, f"writes-{int(warm)}-{rep}")
                os.makedirs(directory)
                store = TierStore(4 * n, pool.block_shape(), torch.float32, directory)
                tier = KVTier(4 * n)
                if warm:
                    ahead = TierPrefetcher(store)
                    ahead.warm(tier)
                    for _ in range(10_000):
                        if ahead.warmed_blocks >= min(n, ahead.window_slots):
                            break
                        time.sleep(0.001)
                    ahead.close()
                slots = tier.allocate(n)
                t = time.perf_counter()
                store.run(pool, [KVCopy(True, b, s) for b, s in zip(range(n), slots)])
                times.append((time.perf_counter() - t) * 1000 * 1000 / (n * BLOCK_SIZE))
                store.close()
            out[f"{label}: engine-thread ms per 1,000 tokens"] = statistics.median(times)
    return out


def _cold_read_ms(store, pool, n: int, directory: str) -> float:
    """A copy of the tier's bytes in a file this process does not map, dropped from the page
    cache (posix_fadvise), read back into the pool: the cost of a restore from disk."""
    import numpy as np

    path = os.path.join(directory, "cold.bin")
    with open(path, "wb") as f:
        f.write(store.data[:n].numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t = time.perf_counter()
        data = np.fromfile(path, dtype=np.float32).reshape(store.data[:n].shape)
        kv = pool.kv.numpy()
        for b in range(n):
            kv[:, :, n + b] = data[b]
        return (time.perf_counter() - t) * 1000
    finally:
        os.close(fd)


def main() -> None:
    parser = bench_parser(__doc__, quick=f"a small swarm: {QUICK.describe()}")
    parser.add_argument("--agents", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--tool-prompt", type=int, default=None)
    parser.add_argument("--pool-share", type=float, default=1 / 3, help="KV pool size as a share of the working set")
    parser.add_argument("--tier-share", type=float, default=0.25,
                        help="second tier of the smalltier systems, as a share of the working set")
    parser.add_argument("--retry-share", type=float, default=None,
                        help="chance that a tool call is retried, superseding the context it followed")
    parser.add_argument("--systems", default="lru,tier,tier+sessions,off")
    parser.add_argument("--measure-tier", action="store_true")
    parser.add_argument("--measure-prefetch", action="store_true",
                        help="restores from a cold tier file with and without the prefetch thread, then exit")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    workload = QUICK if args.quick else FULL
    for name in ("agents", "turns", "tool_prompt", "retry_share"):
        if getattr(args, name) is not None:
            setattr(workload, name, getattr(args, name))
    report: dict = {"workload": workload.describe()}
    if args.measure_tier:
        print("restore vs recompute, ms per 1,000 tokens (default model, float32):")
        report["tier_ms_per_1000_tokens"] = measure_tier()
        for label, ms in report["tier_ms_per_1000_tokens"].items():
            print(f"  {label:<66}{ms:>10.1f}")
    if args.measure_prefetch:
        print("file-backed tier, default model, float32 (median of 5):")
        report["prefetch"] = measure_prefetch()
        for label, ms in report["prefetch"].items():
            print(f"  {label:<86}{ms:>8.1f}")
        if args.json:
            write_json(args.json, report, args)
        return
    pool_blocks = max(8, int(workload.working_set_tokens() * args.pool_share) // BLOCK_SIZE)
    token_bytes = 30 * 2 * 3 * 64 * 4  # the default model's K/V per token, float32
    tier_bytes = 4 * workload.working_set_tokens() * token_bytes  # 4x the working set
    tier_blocks = max(1, int(workload.working_set_tokens() * args.tier_share) // BLOCK_SIZE)
    small_tier = {"kv_offload_memory": tier_blocks * BLOCK_SIZE * token_bytes}
    int8_pool = {"kv_cache_memory": pool_blocks * BLOCK_SIZE * token_bytes, "kv_cache_dtype": "int8"}
    base = dict(num_kv_blocks=pool_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=1024, chunked_prefill_size=512)
    systems = {
        "lru": ("LRU (one tier)", base, False),
        "tier": ("+ tier", {**base, "kv_offload_memory": tier_bytes}, False),
        "tier+sessions": ("+ tier + sessions", {**base, "kv_offload_memory": tier_bytes}, True),
        "smalltier": ("+ small tier", {**base, **small_tier}, False),
        "smalltier+sessions": ("+ small tier + sessions", {**base, **small_tier}, True),
        "off": ("cache off", {**base, "enable_prefix_cache": False}, False),
        "int8": ("LRU, int8 KV, same bytes", {**int8_pool, **{k: v for k, v in base.items() if k != "num_kv_blocks"}},
                 False),
    }
    print(f"workload: {workload.describe()}")
    print(f"working set {workload.working_set_tokens()} tokens; KV pool {pool_blocks} blocks "
          f"({pool_blocks * BLOCK_SIZE} tokens, {args.pool_share:.2f} of it); small tier {tier_blocks} blocks "
          f"({args.tier_share:.2f} of it)")
    results = []
    for key in [s.strip() for s in args.systems.split(",") if s.strip()]:
        label, options, sessions = systems[key]
        print(f"running {label} ...", flush=True)
        results.append(run_system(label, workload, options, sessions, not args.quiet))
    _print(results)
    report["systems"] = [_summary(r) for r in results]
    by = {r.name: r for r in results}
    if "LRU (one tier)" in by and "+ tier + sessions" in by:
        lru, best = by["LRU (one tier)"], by["+ tier + sessions"]
        report["speedup_vs_lru"] = lru.wall_s / best.wall_s
        print(f"\ntier + sessions: {best.reuse_of_ideal:.0%} of ideal reuse (target >= 90%), LRU {lru.reuse_of_ideal:.0%}; "
              f"wall time {report['speedup_vs_lru']:.2f}x LRU's (target >= 1.5x)")
    if "LRU (one tier)" in by and "LRU, int8 KV, same bytes" in by:
        lru, int8 = by["LRU (one tier)"], by["LRU, int8 KV, same bytes"]
        report["int8_vs_lru"] = {"computed_prompt_tokens": [lru.computed_prompt_tokens, int8.computed_prompt_tokens],
                                 "wall_s": [lru.wall_s, int8.wall_s]}
        print(f"int8 KV in the float32 pool's bytes ({int8.stats.get('blocks_total', '?')} blocks against {pool_blocks}): "
              f"{int8.computed_prompt_tokens / max(1, lru.computed_prompt_tokens):.2f}x LRU's prompt tokens computed "
              f"(target <= 0.5x), wall time {lru.wall_s / int8.wall_s:.2f}x better (target >= 1.5x)")
    if "+ small tier" in by and "+ small tier + sessions" in by:
        plain, hinted = by["+ small tier"], by["+ small tier + sessions"]
        report["small_tier_sessions_vs_lru"] = {
            "reuse_of_ideal": [plain.reuse_of_ideal, hinted.reuse_of_ideal],
            "computed_prompt_tokens": [plain.computed_prompt_tokens, hinted.computed_prompt_tokens],
            "wall_s": [plain.wall_s, hinted.wall_s],
        }
        print(f"small tier ({args.tier_share:.2f} of the working set): with sessions {hinted.reuse_of_ideal:.0%} of ideal "
              f"reuse, {hinted.computed_prompt_tokens} prompt tokens computed; LRU order {plain.reuse_of_ideal:.0%}, "
              f"{plain.computed_prompt_tokens}")
    if args.json:
        write_json(args.json, report, args)
    if args.plot:
        _plot(args.plot, results, workload)


def _print(results: list[SystemResult]) -> None:
    head = (f"{'system':<25}{'wall s':>9}{'computed':>10}{'cached':>9}{'restored':>10}{'of ideal':>10}"
            f"{'TTFT p50':>10}{'TTFT p95':>10}{'tier out':>10}")
    print("\n" + head)
    for r in results:
        print(f"{r.name:<25}{r.wall_s:>9.1f}{r.computed_prompt_tokens:>10}{r.cached_tokens:>9}{r.restored_tokens:>10}"
              f"{r.reuse_of_ideal:>10.0%}{r.ttft(0.5):>10.2f}{r.ttft(0.95):>10.2f}"
              f"{r.stats.get('evicted_blocks_tier_dropped', 0):>10}")
    print("(tier out: blocks dropped from the second tier to make room)")
    if results:
        print(f"(prompt tokens {results[0].prompt_tokens}, ideal reuse {results[0].ideal_cached})")


def _summary(r: SystemResult) -> dict:
    keys = ("evicted_blocks", "tier_hits", "restored_blocks", "preemptions")
    return {
        "system": r.name, "wall_s": r.wall_s, "prompt_tokens": r.prompt_tokens,
        "computed_prompt_tokens": r.computed_prompt_tokens, "cached_tokens": r.cached_tokens,
        "restored_tokens": r.restored_tokens, "ideal_cached": r.ideal_cached, "reuse_of_ideal": r.reuse_of_ideal,
        "ttft_p50_s": r.ttft(0.5), "ttft_p95_s": r.ttft(0.95),
        **{k: r.stats.get(k) for k in keys},
        **{k: v for k, v in r.stats.items() if k.startswith("evicted_blocks_")},
    }


def _plot(path: str, results: list[SystemResult], workload: AgentSwarm) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in results]
    panels = [
        ("prompt tokens computed", [r.computed_prompt_tokens for r in results]),
        ("reuse, share of ideal", [r.reuse_of_ideal for r in results]),
        ("wall time (s)", [r.wall_s for r in results]),
        ("TTFT p50 / p95 (s)", None),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    for ax, (title, values) in zip(axes, panels):
        if values is None:
            x = range(len(results))
            ax.bar([i - 0.2 for i in x], [r.ttft(0.5) for r in results], 0.4, label="p50")
            ax.bar([i + 0.2 for i in x], [r.ttft(0.95) for r in results], 0.4, label="p95")
            ax.legend()
        else:
            ax.bar(range(len(results)), values)
        ax.set_xticks(range(len(results)), names, rotation=20, ha="right")
        ax.set_title(title)
    fig.suptitle(f"agent swarm under memory pressure: {workload.describe()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


if __name__ == "__main__":
    main()
