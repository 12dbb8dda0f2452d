"""Prefix reuse across replicas: prefix-affinity routing vs round-robin vs power-of-two choices.

    .venv/bin/python -m bench.bench_cluster                    # 8 sessions x 4 turns, 2 system prompts
    .venv/bin/python -m bench.bench_cluster --plot cluster.png --sessions 16 --turns 3
    .venv/bin/python -m bench.bench_cluster --routers affinity,round_robin   # a subset

Starts a local Ray (loopback), then for each configuration deploys the cluster app afresh
(`radixserve.cluster`, empty caches) and runs the same agent workload against it: sessions
that share system prompts, each growing turn by turn (bench.lib.chat_sessions).
Configurations: `single` (1 replica: one cache sees every request, the reference), and
2 replicas (one engine thread each) under each router:
  affinity      radixserve's PrefixAffinityRouter (sessions, approximate radix trees, balance)
  round_robin   each request to the next replica
  pow2          Ray Serve's default (power of two choices on queue length)
  ray_prefix    Ray Serve LLM's PrefixCacheAffinityRouter (character prefix tree in an actor)
Reuse = cached prompt tokens (usage.prompt_tokens_details.cached_tokens, summed; checked
against the merged /metrics) / the single replica's. Target: affinity >= 95% of single.
On a 2-core machine two replicas cannot run faster than one: the times are not a
throughput result.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from dataclasses import dataclass

import httpx

from bench.lib import chat_sessions
from bench.lib.chat_sessions import ChatSessions
from bench.lib.cli import apply_quick, bench_parser, write_json
from radixserve.cluster.metrics_merge import sample_total

from radixserve.cluster.options import ROUTERS
TARGET = 0.95


@dataclass
class Result:
    name: str
    replicas: int
    turns: list[chat_sessions.Turn]
    wall_s: float
    deploy_s: float
    metrics_cached: float

    @property
    def cached(self) -> int:
        return chat_sessions.cached_tokens(self.turns)

    @property
    def prompt(self) -> int:
        return chat_sessions.prompt_tokens(self.turns)

    def spread(self) -> str:
        """Requests per replica, and whether each system prompt stayed on one replica."""
        counts = Counter(t.replica for t in self.turns)
        homes = {p: {t.replica for t in self.turns if t.system_prompt == p} for p in {t.system_prompt for t in self.turns}}
        split = sum(len(h) > 1 for h in homes.values())
        return f"{'/'.join(str(c) for c in sorted(counts.values(), reverse=True))} ({split} prompt(s) split)"


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick="4 sessions x 2 turns", plot="also draw the reuse ratios (PNG)")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--observation-words", type=int, default=40, help="words of tool output in each user turn")
    parser.add_argument("--think", type=float, default=1.0,
                        help="seconds a tool may run between turns (random within [0, THINK]): arrivals interleave")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated, of {', '.join(ROUTERS)}")
    parser.add_argument("--num-threads", type=int, default=1, help="engine threads per replica")
    parser.add_argument("--port", type=int, default=18230)
    args = parser.parse_args(argv)
    apply_quick(parser, args, sessions=4, turns=2)
    routers = [r for r in args.routers.split(",") if r]
    unknown = set(routers) - set(ROUTERS)
    if unknown:
        parser.error(f"unknown router(s): {', '.join(sorted(unknown))}")
    workload = ChatSessions(args.sessions, args.turns, args.system_prompts, args.max_tokens, args.observation_words,
                        args.think)

    import ray
    from ray import serve

    from radixserve.cluster.app import deploy
    from radixserve.cluster.options import ClusterOptions
    from radixserve.server.options import ServerOptions

    configs = [("single", 1, "pow2")] + [(r, args.replicas, r) for r in routers]
    print("bench_cluster: prefix reuse across replicas (radixserve.cluster on Ray Serve, loopback)")
    print(f"  workload: {workload.describe()}")
    print(f"  model: the default (SmolLM2-135M-Instruct), {args.num_threads} engine thread(s) per replica")
    compared = ", ".join(f"{n} ({k} replica{'s' if k > 1 else ''})" for n, k, _ in configs)
    print(f"  compared: {compared}")
    print(f"  machine: {os.cpu_count()} CPUs (timings are not throughput results on a small shared machine)")
    started = time.monotonic()
    # Logical CPUs: one per replica, and one for ray_prefix's prefix-tree actor (it is never scheduled
    # without one, and its router then waits for it forever).
    ray.init(num_cpus=max(os.cpu_count() or 1, args.replicas) + 1, include_dashboard=False, logging_level="error",
             log_to_driver=False)
    print(f"  ray started in {time.monotonic() - started:.0f}s", flush=True)
    results: list[Result] = []
    engine = {"num_threads": args.num_threads}
    server = ServerOptions()
    url = f"http://127.0.0.1:{args.port}"
    try:
        for name, replicas, router in configs:
            print(f"[{name}] deploying {replicas} replica(s), router {router} ...", flush=True)
            t0 = time.monotonic()
            try:
                deploy(engine, server, ClusterOptions(replicas=replicas, router=router), "127.0.0.1", args.port)
            except Exception as exc:  # e.g. a router that cannot serve these requests
                print(f"[{name}] could not deploy: {type(exc).__name__}: {exc}", flush=True)
                continue
            deploy_s = time.monotonic() - t0
            print(f"[{name}] up in {deploy_s:.0f}s; running the workload", flush=True)
            t0 = time.monotonic()
            try:
                turns = chat_sessions.run(url, workload, timeout_s=90, progress=_progress(name))
            except Exception as exc:
                print(f"[{name}] failed: {type(exc).__name__}: {exc}", flush=True)
                serve.delete("radixserve")
                continue
            wall = time.monotonic() - t0
            metrics = httpx.get(url + "/metrics", timeout=30).text
            results.append(Result(name, replicas, turns, wall, deploy_s,
                                  sample_total(metrics, "radixserve_cached_prompt_tokens_total")))
            print(f"[{name}] done in {wall:.0f}s", flush=True)
            serve.delete("radixserve")
    finally:
        serve.shutdown()
        ray.shutdown()
    _report(results)
    if args.json:
        write_json(args.json, results, args)
    if args.plot and results:
        from bench.lib.report import plot_bars

        single = _single(results)
        names = [r.name for r in results]
        plot_bars(args.plot, f"Cached prompt tokens vs one replica ({args.replicas} replicas, agent workload)", names,
                  {"reuse / single": [r.cached / single if single else 0.0 for r in results]}, "ratio")
    return 0


def _progress(name: str):
    def show(done: int, total: int) -> None:
        if done % max(1, total // 4) == 0 or done == total:
            print(f"[{name}] {done}/{total} requests", flush=True)

    return show


def _single(results: list[Result]) -> int:
    return next((r.cached for r in results if r.name == "single"), 0)


def _report(results: list[Result]) -> None:
    single = _single(results)
    print()
    print(f"{'config':<12}{'replicas':>9}{'requests/replica':>26}{'prompt tok':>12}{'cached':>9}{'hit rate':>10}"
          f"{'reuse/single':>14}{'wall s':>8}")
    for r in results:
        ratio = f"{r.cached / single:.1%}" if single else "-"
        print(f"{r.name:<12}{r.replicas:>9}{r.spread():>26}{r.prompt:>12}{r.cached:>9}{r.cached / r.prompt:>10.1%}"
              f"{ratio:>14}{r.wall_s:>8.1f}")
        if abs(r.metrics_cached - r.cached) > 0.5:
            print(f"  note: /metrics says {r.metrics_cached:.0f} cached tokens for {r.name}")
    affinity = next((r for r in results if r.name == "affinity"), None)
    if affinity is not None and single:
        share = affinity.cached / single
        verdict = "meets" if share >= TARGET else "BELOW"
        print(f"affinity reuse: {share:.1%} of one replica's (target >= {TARGET:.0%}: {verdict} target)")


if __name__ == "__main__":
    sys.exit(main())
