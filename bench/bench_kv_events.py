"""The cost of publishing KV events (--kv-events-endpoint) at full rate, in one run: the same
workload on two engines of the default model in turns, events off and on (with a subscriber
reading them), and the events and batches per second that were sent.

    .venv/bin/python -m bench.bench_kv_events [--quick] [--json out.json] [--plot events.png]

Workload: --prompts unrelated random-token prompts of 96-160 tokens, 8 new tokens each, greedy,
EOS ignored, through a KV pool of --blocks blocks (a fraction of what the prompts need), so
every step stores blocks and evicts others: the most events a step can make.
"""

from __future__ import annotations

import random
import statistics
import threading
import time

import zmq

from bench.lib.cli import apply_quick, bench_parser, write_json
from radixserve import Engine, SamplingParams


def run(engine: Engine, prompts: list[list[int]]) -> dict:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    steps_ms: list[float] = []
    for i in range(0, len(prompts), 8):
        for p in prompts[i:i + 8]:
            engine.add_request(p, params)
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            steps_ms.append((time.perf_counter() - t0) * 1000)
    return {"steps": len(steps_ms), "step_ms_mean": statistics.mean(steps_ms),
            "step_ms_p50": statistics.median(steps_ms), "wall_s": sum(steps_ms) / 1000}


def subscribe(endpoint: str, stop: threading.Event, counts: dict) -> None:
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    while not stop.is_set():
        if sub.poll(100):
            sub.recv_multipart()
            counts["batches"] += 1
    context.destroy(linger=0)


def main() -> None:
    p = bench_parser(__doc__, quick="32 prompts")
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--blocks", type=int, default=64)
    args = p.parse_args()
    apply_quick(p, args, prompts=32)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(96, 161))] for _ in range(args.prompts)]
    off = Engine(num_kv_blocks=args.blocks)
    on = Engine(num_kv_blocks=args.blocks, kv_events_endpoint="tcp://127.0.0.1:*")
    stop, counts = threading.Event(), {"batches": 0}
    reader = threading.Thread(target=subscribe, args=(on.kv_events.endpoint, stop, counts), daemon=True)
    reader.start()
    time.sleep(0.3)
    results: dict[str, list[dict]] = {"off": [], "on": []}
    for rep in range(2):  # in turns, each twice
        for label, engine in (("off", off), ("on", on)):
            print(f"  run {rep + 1}: events {label}", flush=True)
            results[label].append(run(engine, prompts))
    on.kv_events.flush()
    time.sleep(0.3)
    stop.set()
    reader.join()
    best = {label: min(r["step_ms_mean"] for r in runs) for label, runs in results.items()}
    wall_on = sum(r["wall_s"] for r in results["on"])
    report = {"workload": f"{args.prompts} random prompts of 96-160 tokens, 8 new each, {args.blocks}-block pool",
              "step_ms_mean": best, "ratio": best["on"] / best["off"], "events_sent": on.kv_events.events_sent,
              "batches_sent": on.kv_events.sequence + 1, "batches_received": counts["batches"],
              "events_per_s": on.kv_events.events_sent / wall_on, "evicted_blocks": on.cache.evicted_blocks}
    print(f"\nKV events: {report['workload']}; the same workload twice on each engine, in turns")
    print(f"  mean step: events off {best['off']:.2f} ms, on {best['on']:.2f} ms ({report['ratio']:.3f}x)")
    print(f"  sent {report['events_sent']} events in {report['batches_sent']} batches "
          f"({report['events_per_s']:.0f} events/s of stepping), a subscriber received {counts['batches']} batches; "
          f"{report['evicted_blocks']} blocks evicted")
    if args.json:
        write_json(args.json, report, args)
    if args.plot:
        from bench.lib.report import plot_bars

        plot_bars(args.plot, "mean step time, KV events off / on", ["mean step"],
                  {k: [v] for k, v in best.items()}, "ms")
    off.close()
    on.close()


if __name__ == "__main__":
    main()
