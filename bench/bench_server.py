"""Load generator for the HTTP server: Poisson arrivals of streaming /v1/completions requests.

    .venv/bin/python bench/bench_server.py                       # starts `radixserve serve` itself
    .venv/bin/python bench/bench_server.py --url http://127.0.0.1:30000 --rate 2
    .venv/bin/python bench/bench_server.py --plot server.png --server-args "--max-num-seqs 64"

Three phases against one server, each reported on its own:
  shared-prefix  groups of prompts that share a long system prompt, arriving as a Poisson process;
  agent          agents whose prompt is a system prompt with tool descriptions (the same for all),
                 then a task; each step appends the model's answer and a tool observation to the
                 previous step's prompt, so every step extends a cached prefix;
  hit-vs-miss    on an idle server, pairs of requests on a fresh prefix of --probe-prefix-tokens:
                 the first misses the cache, the second (same prefix, new question) hits it.
For each: throughput, time to first token (TTFT) and time per output token (TPOT) p50/p99,
and prefix-cache hit rate from usage.prompt_tokens_details.cached_tokens and from /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench.lib.cli import apply_quick, bench_parser, write_json
from bench.lib.harness import percentile
from bench.lib.client import Record, arrivals, complete
from bench.lib.servers import served

# Common words that are one token each (with their leading space) in most BPE vocabularies.
WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education"
).split()
TOOLS = ("search", "read_file", "write_file", "run_tests", "http_get", "calculator", "calendar", "send_email")


@dataclass
class Phase:
    name: str
    description: str
    records: list[Record] = field(default_factory=list)
    duration_s: float = 0.0
    metrics_prompt: float = 0.0  # /metrics deltas over the phase
    metrics_cached: float = 0.0


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    with _server(args) as url:
        phases = asyncio.run(_run_all(url, args))
    _print_report(args, url, phases)
    if args.json:
        write_json(args.json, phases, args)
    if args.plot:
        _plot(args.plot, phases)
        print(f"\nplot written to {args.plot}")
    return 0


# ---- phases ------------------------------------------------------------------------------


async def _run_all(url: str, args: argparse.Namespace) -> list[Phase]:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits, headers=_auth(args)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        phases = []
        for name in args.workloads:
            await client.post("/flush_cache")
            runner = {"shared-prefix": _shared_prefix, "agent": _agents, "hit-vs-miss": _hit_vs_miss}[name]
            phases.append(await _measured(client, runner, model, args))
        return phases


async def _measured(client: httpx.AsyncClient, runner, model: str, args: argparse.Namespace) -> Phase:
    before = await _cache_counters(client)
    start = time.monotonic()
    phase = await runner(client, model, args)
    phase.duration_s = time.monotonic() - start
    after = await _cache_counters(client)
    phase.metrics_prompt = after[0] - before[0]
    phase.metrics_cached = after[1] - before[1]
    return phase


async def _shared_prefix(client: httpx.AsyncClient, model: str, args: argparse.Namespace) -> Phase:
    rng = random.Random(args.seed)
    systems = [_system_prompt(rng, args.system_tokens, g) for g in range(args.groups)]
    prompts = [
        (g, systems[g] + f"\nUser question {i}: " + _words(rng, args.question_tokens) + "\nAnswer:")
        for g in range(args.groups) for i in range(args.prompts_per_group)
    ]
    rng.shuffle(prompts)
    phase = Phase("shared-prefix", f"{args.groups} groups x {args.prompts_per_group} prompts; "
                  f"system prompt ~{args.system_tokens} words, question ~{args.question_tokens} words, "
                  f"{args.max_tokens} new tokens; Poisson arrivals at {args.rate} req/s")
    bar = tqdm(total=len(prompts), desc="shared-prefix", unit="req", leave=False)

    async def one(delay: float, group: int, prompt: str) -> None:
        await asyncio.sleep(delay)
        phase.records.append(await complete(client, model, prompt, args.max_tokens, f"group{group}"))
        bar.update(1)

    await asyncio.gather(*(one(t, g, p) for t, (g, p) in zip(arrivals(rng, args.rate, len(prompts)), prompts)))
    bar.close()
    return phase


async def _agents(client: httpx.AsyncClient, model: str, args: argparse.Namespace) -> Phase:
    rng = random.Random(args.seed + 1)
    tools = _tool_descriptions(rng, args.tool_tokens)
    phase = Phase("agent", f"{args.agents} agents x {args.steps} steps; tool descriptions ~{args.tool_tokens} "
                  f"words shared by all; each step appends the answer and a ~{args.observation_tokens}-word "
                  f"observation; {args.max_tokens} new tokens; agents start at {args.rate} /s (Poisson)")
    bar = tqdm(total=args.agents * args.steps, desc="agent", unit="req", leave=False)

    async def agent(index: int, delay: float) -> None:
        await asyncio.sleep(delay)
        prompt = tools + f"\nTask {index}: " + _words(rng, args.question_tokens) + "\nThought:"
        for step in range(args.steps):
            record = await complete(client, model, prompt, args.max_tokens, f"step{step}")
            phase.records.append(record)
            bar.update(1)
            prompt += record.text + f"\nAction: {rng.choice(TOOLS)}\nObservation: "
            prompt += _words(rng, args.observation_tokens) + "\nThought:"

    await asyncio.gather(*(agent(i, t) for i, t in enumerate(arrivals(rng, args.rate, args.agents))))
    bar.close()
    return phase


async def _hit_vs_miss(client: httpx.AsyncClient, model: str, args: argparse.Namespace) -> Phase:
    rng = random.Random(args.seed + 2)
    phase = Phase("hit-vs-miss", f"{args.probe_pairs} pairs on an idle server: a fresh ~{args.probe_prefix_tokens}"
                  f"-word prefix + question (miss), then the same prefix + another question (hit)")
    for pair in tqdm(range(args.probe_pairs), desc="hit-vs-miss", unit="pair", leave=False):
        prefix = _system_prompt(rng, args.probe_prefix_tokens, 1000 + pair)
        for label in ("miss", "hit"):
            prompt = prefix + "\nQuestion: " + _words(rng, args.question_tokens) + "\nAnswer:"
            phase.records.append(await complete(client, model, prompt, args.max_tokens, label))
    return phase


# ---- one request ---------------------------------------------------------------------------


# ---- text ----------------------------------------------------------------------------------


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _system_prompt(rng: random.Random, n_words: int, tag: int) -> str:
    return f"System {tag}: you are assistant number {tag}. Background:" + " " + _words(rng, n_words)


def _tool_descriptions(rng: random.Random, n_words: int) -> str:
    per_tool = max(1, n_words // len(TOOLS))
    lines = [f"- {name}(arg): " + _words(rng, per_tool) for name in TOOLS]
    return "You are an agent. You can call these tools:\n" + "\n".join(lines)


# ---- server and metrics --------------------------------------------------------------------


@contextlib.contextmanager
def _server(args: argparse.Namespace):
    """The --url given, or a `radixserve serve` subprocess on a free port (stopped at the end)."""
    if args.url:
        yield args.url.rstrip("/")
        return
    command = [sys.executable, "-m", "radixserve", "serve", "--log-level", "warning"]
    command += (["--model", args.model] if args.model else []) + shlex.split(args.server_args)
    with served(command, env=dict(os.environ, RADIXSERVE_API_KEY=args.api_key or "")) as url:
        yield url


async def _cache_counters(client: httpx.AsyncClient) -> tuple[float, float]:
    """(prompt tokens, cached prompt tokens) counted by the engine, from /metrics."""
    values = {}
    for family in text_string_to_metric_families((await client.get("/metrics")).text):
        for sample in family.samples:
            values[sample.name] = sample.value
    return values.get("radixserve_prompt_tokens_total", 0.0), values.get("radixserve_cached_prompt_tokens_total", 0.0)


def _auth(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


# ---- report --------------------------------------------------------------------------------


def _print_report(args: argparse.Namespace, url: str, phases: list[Phase]) -> None:
    print(f"\nradixserve server benchmark against {url} (streaming /v1/completions, greedy, ignore_eos)")
    for phase in phases:
        _print_phase(phase)
    probe = next((p for p in phases if p.name == "hit-vs-miss"), None)
    if probe is not None:
        _print_probe(probe)


def _print_phase(phase: Phase) -> None:
    ok = [r for r in phase.records if r.error is None]
    failed = len(phase.records) - len(ok)
    out_tokens = sum(r.completion_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    print(f"\n== {phase.name}: {phase.description}")
    print(f"   requests {len(ok)} ok, {failed} failed in {phase.duration_s:.1f} s: "
          f"{len(ok) / phase.duration_s:.2f} req/s, {out_tokens / phase.duration_s:.1f} output tok/s, "
          f"{(prompt_tokens + out_tokens) / phase.duration_s:.1f} total tok/s")
    print(f"   prompt tokens {prompt_tokens}, mean {prompt_tokens / max(1, len(ok)):.0f} per request")
    print(f"   TTFT p50 {percentile([r.ttft for r in ok], 50):.3f} s, p99 {percentile([r.ttft for r in ok], 99):.3f} s;  "
          f"TPOT p50 {percentile([r.tpot for r in ok], 50) * 1000:.1f} ms, p99 {percentile([r.tpot for r in ok], 99) * 1000:.1f} ms")
    metric_rate = phase.metrics_cached / phase.metrics_prompt if phase.metrics_prompt else 0.0
    print(f"   cache hit rate {cached / max(1, prompt_tokens):.1%} of prompt tokens (usage), "
          f"{metric_rate:.1%} (/metrics)")
    hits, misses = [r for r in ok if r.hit], [r for r in ok if not r.hit]
    if hits and misses:
        print(f"   TTFT p50 of {len(hits)} requests with most of the prompt cached {percentile([r.ttft for r in hits], 50):.3f} s"
              f" vs {len(misses)} without {percentile([r.ttft for r in misses], 50):.3f} s")
    for r in phase.records:
        if r.error is not None:
            print(f"   failed ({r.label}): {r.error}")


def _print_probe(phase: Phase) -> None:
    miss = [r for r in phase.records if r.label == "miss" and r.error is None]
    hit = [r for r in phase.records if r.label == "hit" and r.error is None]
    if not miss or not hit:
        return
    miss_ttft, hit_ttft = percentile([r.ttft for r in miss], 50), percentile([r.ttft for r in hit], 50)
    ratio = hit_ttft / miss_ttft
    print("\n== cached prefix vs miss, same run, idle server")
    print(f"   prompts: miss {_mean([r.prompt_tokens for r in miss]):.0f} tokens "
          f"({_mean([r.cached_tokens for r in miss]):.0f} cached), hit {_mean([r.prompt_tokens for r in hit]):.0f} "
          f"tokens ({_mean([r.cached_tokens for r in hit]):.0f} cached)")
    print(f"   TTFT p50: miss {miss_ttft:.3f} s, hit {hit_ttft:.3f} s -> hit/miss = {ratio:.1%} "
          f"(target < 20%: {'met' if ratio < 0.2 else 'NOT met'})")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _plot(path: str, phases: list[Phase]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(phases), figsize=(5 * len(phases), 4), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        groups = {"hit": [r.ttft for r in phase.records if r.hit and r.ttft is not None],
                  "miss": [r.ttft for r in phase.records if not r.hit and r.ttft is not None]}
        labels = [k for k, v in groups.items() if v]
        ax.boxplot([groups[k] for k in labels], tick_labels=labels)
        ax.set_title(phase.name)
        ax.set_ylabel("time to first token (s)")
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_quick(parser, args, groups=2, prompts_per_group=3, agents=2, steps=2, probe_pairs=2)
    return args


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser(__doc__, quick="2 groups of 3 prompts, 2 agents x 2 steps, 2 probe pairs",
                     plot="write a TTFT plot (hit vs miss per phase) here (PNG)",
                     json_help="write every phase and request here (JSON)")
    p.add_argument("--url", help="a running server; without it one is started")
    p.add_argument("--model", help="model for the started server (default: the default model)")
    p.add_argument("--server-args", default="", help="extra flags for the started server")
    p.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"))
    p.add_argument("--workloads", nargs="+", default=["shared-prefix", "agent", "hit-vs-miss"],
                   choices=["shared-prefix", "agent", "hit-vs-miss"])
    p.add_argument("--rate", type=float, default=1.0, help="arrivals per second (requests, or agent starts)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=1000, help="words of each group's system prompt")
    p.add_argument("--question-tokens", type=int, default=20)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tool-tokens", type=int, default=800)
    p.add_argument("--observation-tokens", type=int, default=40)
    p.add_argument("--probe-pairs", type=int, default=4)
    p.add_argument("--probe-prefix-tokens", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    return p


if __name__ == "__main__":
    sys.exit(main())
