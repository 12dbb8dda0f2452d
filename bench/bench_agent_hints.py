"""Agent hints measured on the default model, each against the same run without the hint:

1. priority: a backlog of --backlog plain requests, then --agents agent turns queued behind it;
   the agent turns' TTFT p95 with priority 10 against without (and the backlog's own).
2. ttl_s: an agent's turn, then a tool pause during which other traffic (--flood prompts, two
   at a time) passes through a KV pool too small to keep everything (past the LRU horizon);
   the next turn's cached tokens and TTFT with ttl_s against without.
3. speculative_prefill: --swarm agents, --turns chat turns each through the HTTP server (the
   openai client, streamed): every next turn's TTFT and cached tokens with the hint against
   without.

    .venv/bin/python -m bench.bench_agent_hints [--quick] [--json out.json] [--plot hints.png]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.lib.cli import apply_quick, bench_parser, write_json
from bench.lib.harness import percentile
from radixserve import Engine, SamplingParams
from radixserve.core.agent_hints import AgentHints


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def drain(engine: Engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def ttfts(engine: Engine, ids: list[str]) -> dict[str, float]:
    """Step until every request in `ids` has its first token; seconds from its arrival."""
    requests = {i: engine._requests[i] for i in ids}
    out: dict[str, float] = {}
    while engine.has_unfinished_requests():
        engine.step()
        for i, r in requests.items():
            if i not in out and r.first_token_time is not None:
                out[i] = r.first_token_time - r.arrival_time
    return out


def bench_priority(engine: Engine, args: argparse.Namespace) -> dict:
    rng = random.Random(1)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    backlog = [prompt(rng, 192) for _ in range(args.backlog)]
    agents = [prompt(rng, 96) for _ in range(args.agents)]
    result = {}
    for label, priority in (("without", 0), ("with", 10)):
        engine.flush_cache()
        plain = [engine.add_request(p, params) for p in backlog]
        hinted = [engine.add_request(p, params, hints=AgentHints(priority=priority)) for p in agents]
        times = ttfts(engine, plain + hinted)
        result[label] = {"agent_p95_s": percentile([times[i] for i in hinted], 95),
                         "backlog_p95_s": percentile([times[i] for i in plain], 95)}
    result["agent_p95_ratio"] = result["without"]["agent_p95_s"] / result["with"]["agent_p95_s"]
    return result


def bench_ttl(engine: Engine, args: argparse.Namespace) -> dict:
    rng = random.Random(2)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    history = prompt(rng, 512)
    flood = [prompt(rng, 256) for _ in range(args.flood)]
    result = {}
    for label, hints in (("without", None), ("with", AgentHints(ttl_s=120.0))):
        engine.flush_cache()
        engine.add_request(history, params, hints=hints)
        drain(engine)
        for i in range(0, len(flood), 2):  # the tool pause: other agents' traffic, two at a time
            for p in flood[i:i + 2]:
                engine.add_request(p, params)
            drain(engine)
        request = engine._requests[engine.add_request(history + prompt(rng, 32), params)]
        drain(engine)
        result[label] = {"cached_tokens": request.cached_tokens, "ttft_s": request.first_token_time - request.arrival_time}
        engine.release_hints()
    result["ttft_ratio"] = result["without"]["ttft_s"] / result["with"]["ttft_s"]
    return result


def bench_speculative_prefill(engine: Engine, args: argparse.Namespace) -> dict:
    import openai

    from radixserve.server import ServerOptions, create_app
    from radixserve.server.testing import BackgroundServer

    rng = random.Random(3)
    words = "plan search read file patch test build deploy check log error retry merge branch".split()
    tasks = [" ".join(rng.choice(words) for _ in range(60)) for _ in range(args.swarm)]
    result = {}
    with BackgroundServer(create_app(engine, ServerOptions())) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
        for label, warm in (("without", False), ("with", True)):
            engine_flush(server)
            times, cached = [], []
            for a, task in enumerate(tasks):
                messages = [{"role": "system", "content": f"You are agent {a}. Tools: search, read, patch."},
                            {"role": "user", "content": task}]
                for turn in range(args.turns):
                    t0 = time.perf_counter()
                    stream = client.chat.completions.create(
                        model=engine.model_name, messages=messages, max_tokens=24, temperature=0, stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"cache_salt": f"{label}-{a}", "agent_hints": {"speculative_prefill": warm}})
                    first, text, usage = None, "", None
                    for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content and first is None:
                            first = time.perf_counter() - t0
                        if chunk.choices:
                            text += chunk.choices[0].delta.content or ""
                        usage = chunk.usage or usage
                    if turn:  # a next turn: what the hint is for
                        times.append(first if first is not None else time.perf_counter() - t0)
                        cached.append(usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens)
                    time.sleep(args.pause_s)  # the tool runs; the warm-up runs meanwhile
                    messages = messages + [{"role": "assistant", "content": text},
                                           {"role": "user", "content": f"tool result {turn}: ok"}]
            result[label] = {"next_turn_ttft_mean_s": statistics.mean(times),
                             "next_turn_ttft_p95_s": percentile(times, 95),
                             "cached_share_mean": statistics.mean(cached), "turns": len(times)}
    stats = engine.stats()
    result["speculative_prefills"] = stats["speculative_prefills"]
    result["speculative_prefill_tokens"] = stats["speculative_prefill_tokens"]
    result["ttft_ratio"] = result["without"]["next_turn_ttft_mean_s"] / result["with"]["next_turn_ttft_mean_s"]
    return result


def engine_flush(server) -> None:
    import httpx

    httpx.post(server.url + "/flush_cache", timeout=60)


def main() -> None:
    p = bench_parser(__doc__, quick="12 backlog requests, 4 agents, a swarm of 2 x 3 turns")
    p.add_argument("--backlog", type=int, default=24)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--flood", type=int, default=12)
    p.add_argument("--blocks", type=int, default=160, help="KV pool blocks of the TTL part (16 tokens each)")
    p.add_argument("--swarm", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--pause-s", type=float, default=2.0)
    args = p.parse_args()
    apply_quick(p, args, backlog=12, agents=4, swarm=2, turns=3)
    engine = Engine(max_num_seqs=4)
    report = {"priority": bench_priority(engine, args)}
    pr = report["priority"]
    print(f"\npriority: {args.backlog} plain requests of 192 tokens queued, then {args.agents} agent turns of 96 "
          "(8 new tokens each, max_num_seqs 4)")
    for label in ("without", "with"):
        print(f"  {label:>7} priority 10: agent TTFT p95 {pr[label]['agent_p95_s']:.2f} s, "
              f"backlog TTFT p95 {pr[label]['backlog_p95_s']:.2f} s")
    print(f"  agent TTFT p95 without / with: {pr['agent_p95_ratio']:.2f}x")
    engine.close()
    small = Engine(num_kv_blocks=args.blocks)
    report["ttl"] = bench_ttl(small, args)
    tl = report["ttl"]
    print(f"\nttl_s: an agent's 512-token context, a tool pause during which {args.flood} prompts of 256 tokens pass "
          f"(two at a time) through a {args.blocks}-block pool, then its next turn (+32 tokens)")
    for label in ("without", "with"):
        print(f"  {label:>7} ttl_s 120: next turn cached {tl[label]['cached_tokens']} tokens, "
              f"TTFT {tl[label]['ttft_s'] * 1000:.0f} ms")
    print(f"  next-turn TTFT without / with: {tl['ttft_ratio']:.2f}x")
    small.close()
    served = Engine()
    report["speculative_prefill"] = bench_speculative_prefill(served, args)
    sp = report["speculative_prefill"]
    print(f"\nspeculative_prefill: {args.swarm} agents x {args.turns} chat turns over HTTP (24 new tokens, "
          f"{args.pause_s:g} s tool pause), next turns only")
    for label in ("without", "with"):
        s = sp[label]
        print(f"  {label:>7}: next-turn TTFT mean {s['next_turn_ttft_mean_s'] * 1000:.0f} ms, "
              f"p95 {s['next_turn_ttft_p95_s'] * 1000:.0f} ms, cached share {s['cached_share_mean']:.1%} "
              f"({s['turns']} turns)")
    print(f"  next-turn TTFT without / with: {sp['ttft_ratio']:.2f}x; {sp['speculative_prefills']} warm-ups computed "
          f"{sp['speculative_prefill_tokens']} tokens")
    served.close()
    if args.json:
        write_json(args.json, report, args)
    if args.plot:
        from bench.lib.report import plot_bars

        plot_bars(args.plot, "agent hints: without / with", ["priority: agent TTFT p95", "ttl: next-turn TTFT",
                                                              "spec. prefill: next-turn TTFT"],
                  {label: [pr[label]["agent_p95_s"], tl[label]["ttft_s"], sp[label]["next_turn_ttft_mean_s"]]
                   for label in ("without", "with")}, "s")


if __name__ == "__main__":
    main()
