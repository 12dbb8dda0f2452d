"""Prefill/decode disaggregation: do long prompts still stall running streams?

    .venv/bin/python -m bench.bench_disagg                       # 2 runs of each, 40 s each
    .venv/bin/python -m bench.bench_disagg --duration 60 --repeats 3 --rate 0.25
    .venv/bin/python -m bench.bench_disagg --chunk 128 --rate 0.12   # shorter, more frequent stalls
    .venv/bin/python -m bench.bench_disagg --configs colocated,disagg,conditional --plot disagg.png
    .venv/bin/python -m bench.bench_disagg --transfer-only       # transfer vs recompute, no Ray

Starts a local Ray and, for each configuration, deploys the cluster app afresh:
  colocated   --replicas 2 (one engine thread each, prefix-affinity router)
  disagg      --prefill-replicas 1 --decode-replicas 1 (one engine thread each)
  conditional the same, with --prefill-backlog-tokens (--configs colocated,disagg,conditional):
              the decode replica computes a prompt itself while the prefill replica is backed up;
              conditional:N sets that limit to N tokens (a sweep: conditional:2048,conditional:4096)
Workload, the same arrivals for both (seeded): two streams decode all along (a new one starts
when one ends), while long prompts (--min-len..--max-len random token ids, distinct) arrive as
a Poisson process of --rate per second, each streaming --prompt-tokens tokens.
Reported: the streams' inter-token gap p50/p95 and the long prompts' TTFT p50/p95, per run and
their spread over runs. Targets (issue 27): gap p95 <= 0.5x colocated, TTFT p95 <= 1.5x.
`--transfer-only`: on in-process engines, the cost of moving 1,000 tokens' KV (export,
pickling as a transport stand-in, import) against computing them, and the decode engine
thread's share of an import: all of it when the bytes are copied there (a plain KVHandoff),
only the reservation and the commit when they are copied on another thread (a PendingImport,
as a decode replica does).
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx

from bench.lib.cli import apply_quick, bench_parser, write_json
from bench.lib.harness import percentile
from bench.lib.client import stream_json

MODEL = "SmolLM2-135M-Instruct"
ENGINE = {"num_threads": 1}


@dataclass
class Run:
    name: str
    gaps: list[float] = field(default_factory=list)  # seconds between a stream's token events
    ttfts: list[float] = field(default_factory=list)  # long prompts: seconds to the first token
    by_arrival: list[tuple[float, int, float]] = field(default_factory=list)  # (arrival s, tokens, TTFT s)
    stream_ttfts: list[float] = field(default_factory=list)  # the streams' own requests
    stream_tokens: int = 0
    duration_s: float = 0.0
    errors: int = 0

    @property
    def stream_rate(self) -> float:
        """Tokens per second of each stream, on average (a stall shows here even when it is
        spent before a stream request's first token)."""
        return self.stream_tokens / (2 * self.duration_s) if self.duration_s else 0.0


def stream(url: str, body: dict) -> tuple[float | None, list[float]]:
    """(TTFT, the times of every token event) of one streamed completion."""
    start = time.monotonic()
    times: list[float] = []
    with httpx.Client(timeout=600) as client:
        for chunk in stream_json(client, url + "/v1/completions", body):
            if any(c.get("text") for c in chunk.get("choices", [])):
                times.append(time.monotonic())
    return (times[0] - start if times else None), times


def workload(url: str, run: Run, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    arrivals, t = [], rng.expovariate(args.rate)
    while t < args.duration:
        arrivals.append((t, [rng.randrange(100, 40000) for _ in range(rng.randint(args.min_len, args.max_len))]))
        t += rng.expovariate(args.rate)
    stop = time.monotonic() + args.duration
    begin = time.monotonic()

    def decoder(i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            body = {"model": MODEL, "prompt": f"Stream {i}.{n}: tell a long story.", "max_tokens": args.stream_tokens,
                    "temperature": 0, "ignore_eos": True, "session_id": f"stream-{i}"}
            n += 1
            try:
                ttft, times = stream(url, body)
            except Exception:
                run.errors += 1
                continue
            if ttft is not None:
                run.stream_ttfts.append(ttft)
            run.stream_tokens += len(times)
            run.gaps += [b - a for a, b in zip(times[1:], times[2:])]  # from the 2nd token: decode gaps only

    def prompt(at: float, ids: list[int]) -> None:
        time.sleep(max(0.0, begin + at - time.monotonic()))
        body = {"model": MODEL, "prompt": ids, "max_tokens": args.prompt_tokens, "temperature": 0, "ignore_eos": True}
        try:
            ttft, _ = stream(url, body)
            if ttft is not None:
                run.ttfts.append(ttft)
                run.by_arrival.append((at, len(ids), ttft))
        except Exception:
            run.errors += 1

    threads = [threading.Thread(target=decoder, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=prompt, args=a) for a in arrivals]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    run.duration_s = time.monotonic() - begin


def cluster_runs(args: argparse.Namespace) -> list[Run]:
    import ray
    from ray import serve

    from radixserve.cluster.app import deploy
    from radixserve.cluster.options import ClusterOptions, PDOptions
    from radixserve.server.options import ServerOptions
    from tests.subprocess_server import free_port

    def options(name: str) -> ClusterOptions:
        if name == "colocated":
            return ClusterOptions(replicas=2, app_name="bench-colocated")
        if name == "disagg":
            return ClusterOptions(prefill_replicas=1, decode_replicas=1, app_name="bench-disagg")
        kind, _, limit = name.partition(":")
        if kind != "conditional":
            raise SystemExit(f"unknown config {name!r}: colocated, disagg, conditional or conditional:N")
        pd = PDOptions(prefill_backlog_tokens=int(limit) if limit else args.prefill_backlog_tokens)
        return ClusterOptions(prefill_replicas=1, decode_replicas=1, app_name="bench-conditional", pd=pd)

    configs = {name: options(name) for name in args.configs.split(",")}
    runs = []
    ray.init(num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False)
    try:
        for repeat in range(args.repeats):
            for name in args.configs.split(","):
                port = free_port()
                engine = {**ENGINE, **({"chunked_prefill_size": args.chunk} if args.chunk else {})}
                deploy(engine, ServerOptions(), configs[name], "127.0.0.1", port)
                url = f"http://127.0.0.1:{port}"
                stream(url, {"model": MODEL, "prompt": "Warm up.", "max_tokens": 4, "temperature": 0})
                run = Run(name)
                workload(url, run, args)
                runs.append(run)
                print(f"run {repeat + 1} {name}: " + line(run), flush=True)
                print("  TTFT by arrival: " + ", ".join(f"{a:.0f}s/{n}t: {t:.1f}s" for a, n, t in sorted(run.by_arrival)))
                if name != "colocated":
                    print("  " + transfer_line(url), flush=True)
                serve.shutdown()
    finally:
        serve.shutdown()
        ray.shutdown()
    return runs


def line(run: Run) -> str:
    return (f"gap p50 {percentile(run.gaps, 50) * 1000:.0f} ms  p95 {percentile(run.gaps, 95) * 1000:.0f} ms  "
            f"TTFT p50 {percentile(run.ttfts, 50):.2f} s  p95 {percentile(run.ttfts, 95):.2f} s  "
            f"stream {run.stream_rate:.1f} tok/s, stream TTFT p95 {percentile(run.stream_ttfts, 95):.2f} s "
            f"({len(run.gaps)} gaps, {len(run.ttfts)} prompts, {run.errors} errors)")


def transfer_line(url: str) -> str:
    """What the replicas' metrics say about the run's transfers (summed over replicas)."""
    from radixserve.cluster.metrics_merge import sample_total

    text = httpx.get(url + "/metrics", timeout=60).text
    names = ["kv_received_tokens", "kv_received_bytes", "kv_transfer_ms", "kv_import_ms", "kv_export_ms",
             "kv_blocks_already_cached", "kv_fallback_recomputes", "kv_remote_prefills", "kv_backlog_local_prefills"]
    values = {n: sample_total(text, f"radixserve_{n}_total") for n in names}
    tokens = values["kv_received_tokens"] or float("nan")
    per_k = 1000.0 / tokens
    return (f"received {values['kv_received_tokens']:.0f} tokens ({values['kv_received_bytes'] / 1e6:.0f} MB) in "
            f"{values['kv_remote_prefills']:.0f} remote prefills; per 1,000 tokens: fetch "
            f"{values['kv_transfer_ms'] * per_k:.0f} ms, import {values['kv_import_ms'] * per_k:.0f} ms, export "
            f"{values['kv_export_ms'] * per_k:.0f} ms; {values['kv_blocks_already_cached']:.0f} blocks already "
            f"cached, {values['kv_fallback_recomputes']:.0f} fallback recomputes, "
            f"{values['kv_backlog_local_prefills']:.0f} prompts computed on the decode replica (backlog)")


def report(runs: list[Run]) -> None:
    by = {n: [r for r in runs if r.name == n] for n in dict.fromkeys(r.name for r in runs)}
    for name, rs in by.items():
        g = [percentile(r.gaps, 95) * 1000 for r in rs]
        t = [percentile(r.ttfts, 95) for r in rs]
        print(f"{name:10s} gap p95 ms {statistics.mean(g):.0f} (runs {', '.join(f'{x:.0f}' for x in g)})  "
              f"TTFT p95 s {statistics.mean(t):.2f} (runs {', '.join(f'{x:.2f}' for x in t)})")
    base = by.get("colocated")
    for name in by:
        if base and name != "colocated":
            g = statistics.mean(map(_gap_p95, by[name])) / statistics.mean(map(_gap_p95, base))
            t = statistics.mean(map(_ttft_p95, by[name])) / statistics.mean(map(_ttft_p95, base))
            print(f"{name} / colocated: gap p95 {g:.2f}x (target <= 0.5), TTFT p95 {t:.2f}x (target <= 1.5)")
            pairs = list(zip(base, by[name]))  # run k of each config: the same arrivals, back to back
            print("  run by run: gap p95 " + ", ".join(f"{_gap_p95(r) / _gap_p95(b):.2f}x" for b, r in pairs)
                  + "; TTFT p95 " + ", ".join(f"{_ttft_p95(r) / _ttft_p95(b):.2f}x" for b, r in pairs))


def _gap_p95(run: Run) -> float:
    return percentile(run.gaps, 95)


def _ttft_p95(run: Run) -> float:
    return percentile(run.ttfts, 95)


def plot(path: str, runs: list[Run]) -> None:
    """Each run's gap p95 and TTFT p95, one column of points per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.name for r in runs))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, title, value in ((axes[0], "streams' inter-token gap p95 (ms)", lambda r: percentile(r.gaps, 95) * 1000),
                             (axes[1], "long prompts' TTFT p95 (s)", lambda r: percentile(r.ttfts, 95))):
        for i, name in enumerate(names):
            ys = [value(r) for r in runs if r.name == name]
            ax.scatter([i] * len(ys), ys)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def transfer_only(args: argparse.Namespace) -> None:
    """Transfer cost per 1,000 tokens against recomputing them, two in-process engines."""
    import pickle

    from radixserve import Engine, SamplingParams

    p, d, d2 = Engine(**ENGINE), Engine(**ENGINE), Engine(**ENGINE)
    rng = random.Random(args.seed)
    n = 1024
    for trial in range(args.repeats):
        prompt = [rng.randrange(100, 40000) for _ in range(n)]
        t0 = time.perf_counter()
        first = p.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
        compute = time.perf_counter() - t0
        t1 = time.perf_counter()
        handoff = p.kv_transfer.export(prompt, None, 0, first)
        t2 = time.perf_counter()
        wire = pickle.loads(pickle.dumps(handoff, protocol=5))
        t3 = time.perf_counter()
        prepared = d.prepare(prompt, SamplingParams(max_tokens=1, temperature=0))
        sync_before = d.stats().get("kv_import_engine_ms", 0.0)  # no kv_* keys before a first transfer
        d.admit_handoff(prepared, wire)
        t4 = time.perf_counter()
        split_engine_ms, split_copy_ms = reserved_import(d2, prompt, pickle.loads(pickle.dumps(handoff, protocol=5)))
        p.kv_transfer.release(handoff.handoff_id)
        for engine in (d, d2):
            while engine.has_unfinished_requests():
                engine.step()
        per = 1000 / n
        sync_engine_ms = d.stats()["kv_import_engine_ms"] - sync_before
        print(f"  decode engine thread per 1k tokens: copy on it {sync_engine_ms * per:.1f} ms; reserved, copied on "
              f"another thread {split_engine_ms * per:.2f} ms (the copy there: {split_copy_ms * per:.1f} ms)", flush=True)
        print(f"trial {trial + 1}: compute {compute * per * 1000:.0f} ms/1k tokens; transfer {(t4 - t1) * per * 1000:.1f} "
              f"ms/1k (export {(t2 - t1) * per * 1000:.1f}, serialize {(t3 - t2) * per * 1000:.1f}, import "
              f"{(t4 - t3) * per * 1000:.1f}); {handoff.nbytes * per / 1e6:.1f} MB/1k tokens "
              f"({handoff.dtype}, {handoff.num_blocks} blocks)", flush=True)


def reserved_import(d, prompt: list[int], wire) -> tuple[float, float]:
    """(engine-thread ms, copy ms) of an import reserved on `d`'s thread, copied on another."""
    from radixserve import SamplingParams

    before = d.stats()
    pending = d.kv_transfer.reserve(wire)
    copier = threading.Thread(target=pending.copy)
    copier.start()
    copier.join()
    d.admit_handoff(d.prepare(prompt, SamplingParams(max_tokens=1, temperature=0)), pending)
    after = d.stats()
    return (after["kv_import_engine_ms"] - before.get("kv_import_engine_ms", 0.0),
            after["kv_import_ms"] - before.get("kv_import_ms", 0.0))


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick="20 s runs, one repeat", plot="also draw each run's gap and TTFT p95 (PNG)")
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rate", type=float, default=0.2, help="long prompts per second (Poisson)")
    parser.add_argument("--min-len", type=int, default=1000)
    parser.add_argument("--max-len", type=int, default=2000)
    parser.add_argument("--prompt-tokens", type=int, default=4, help="tokens each long prompt generates")
    parser.add_argument("--stream-tokens", type=int, default=120, help="tokens each stream generates")
    parser.add_argument("--configs", default="colocated,disagg")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-backlog-tokens", type=int, default=2048,
                        help="the conditional config's PDOptions.prefill_backlog_tokens")
    parser.add_argument("--chunk", type=int, default=0,
                        help="chunked_prefill_size of every engine, both configurations (0: the default)")
    parser.add_argument("--transfer-only", action="store_true")
    args = parser.parse_args(argv)
    apply_quick(parser, args, duration=20.0, repeats=1)
    if args.transfer_only:
        transfer_only(args)
        return 0
    runs = cluster_runs(args)
    report(runs)
    if args.json:
        write_json(args.json, runs, args)
    if args.plot:
        plot(args.plot, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
