"""An agent swarm through NVIDIA Dynamo's frontend onto 2 radixserve workers (python -m
radixserve.dynamo), once with `--router-mode kv` (the router follows the workers' KV events)
and once with `round-robin`: 16 agents x 5 turns over 4 shared system prompts, each turn the
whole conversation re-sent (the frontend templates it). Printed: the share of the ideal reuse
each mode reached (prompt tokens served from a worker's cache / what one unbounded cache
would have served: each prompt's longest block-aligned prefix shared with an earlier prompt
and its reply), errors, and where the rest went: routing (the ideal on the worker the request
went to, one unbounded cache per worker, falls short of the ideal: its prefix was on the
other worker) or the worker's cache (the worker held less than that); by turn. The kv run's
frontend gets --router-args (default: the flags radixserve.dynamo.worker.ROUTER_ARGS
recommends, the recipe of docs/cluster.md; "" for Dynamo's defaults). Then, in the kv run, whether the
router's view equals the workers' caches after the swarm, a demotion to the second tier, a
flush and a restart of one worker: the view of Dynamo's own KV router (dynamo.llm.KvRouter,
in this process, reading the events the workers relay on Dynamo's event plane, as the
frontend's router does) and of its standalone indexer (python -m dynamo.indexer, reading the
workers' ZMQ streams directly).

    python -m bench.bench_dynamo_swarm            # about 6 minutes on 2 cores
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai

from bench.lib.cli import apply_quick, bench_parser, write_json
from radixserve.dynamo.worker import ROUTER_ARGS as DYNAMO_ROUTER_ARGS

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16
ENDPOINT = "radixserve.backend.generate"
# The frontend flags radixserve.dynamo.worker recommends (prefill weighed 8x a resident block, a
# routed prefix counted as held until its KV events arrive, a held block worth two of queued
# prefill; the reasons there and in docs/cluster.md).
ROUTER_ARGS = " ".join(DYNAMO_ROUTER_ARGS)
TOPICS = ["refunds", "returns", "lost parcels", "customs", "damaged goods", "address changes", "delivery times",
          "insurance"]


def _port() -> int:
    """A free port below 32768 (Dynamo reads DYN_SYSTEM_PORT as an i16)."""
    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def system_prompt(k: int) -> str:
    rules = " ".join(f"Rule {k}.{i}: when asked about {TOPICS[(k + i) % len(TOPICS)]}, answer from the policy "
                     f"manual section {k * 10 + i} and say so." for i in range(8))
    return f"You are support agent team {k} of a shipping company. {rules} Keep every answer short."


class Cluster:
    """2 workers (fixed event and system ports, so a restarted worker is found again), the
    frontend, and Dynamo's standalone indexer on the workers' events (kv runs)."""

    def __init__(self, mode: str, tmp: Path, args):
        self.mode, self.tmp, self.args = mode, tmp, args
        self.env = {**os.environ, "DYN_FILE_KV": str(tmp / "discovery"), "DYN_LOG": "warn"}
        self.http = _port()
        self.events = [_port() for _ in range(2)]
        self.system = [_port() for _ in range(2)]
        self.index_port = _port()
        self.workers: list[subprocess.Popen | None] = [None, None]
        self.others: list[subprocess.Popen] = []

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "a")
        return subprocess.Popen([sys.executable, *argv], env=env or self.env, stdout=log, stderr=subprocess.STDOUT)

    def start_worker(self, i: int) -> None:
        env = {**self.env, "DYN_SYSTEM_ENABLED": "true", "DYN_SYSTEM_PORT": str(self.system[i])}
        self.workers[i] = self._spawn(f"worker{i}", [
            "-m", "radixserve.dynamo", "--num-kv-blocks", str(self.args.kv_blocks), "--kv-offload-memory",
            str(self.args.tier_bytes), "--kv-events-port", str(self.events[i])], env)
        self._wait(lambda: self._ready(i), f"worker {i}")

    def _ready(self, i: int) -> bool:
        try:
            return httpx.post(f"http://127.0.0.1:{self.system[i]}/engine/cache_blocks", json={}, timeout=5).is_success
        except httpx.HTTPError:
            return False

    def start(self) -> None:
        for i in range(2):
            self.start_worker(i)
        extra = shlex.split(self.args.router_args) if self.mode == "kv" else []
        self.others.append(self._spawn("frontend", ["-m", "dynamo.frontend", "--router-mode", self.mode,
                                                    "--discovery-backend", "file", "--http-host", "127.0.0.1",
                                                    "--http-port", str(self.http), *extra]))
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.http}/v1", api_key="x", max_retries=0,
                                    timeout=600)
        self._wait(self._listed, "frontend")
        if self.mode == "kv":
            self.others.append(self._spawn("indexer", ["-m", "dynamo.indexer", "--block-size", str(BLOCK),
                                                       "--port", str(self.index_port), "--threads", "1"]))
            self._wait(lambda: self._get(f"http://127.0.0.1:{self.index_port}/dump") is not None, "indexer")
            for i in range(2):
                self.register(i)
            self.router = RouterView(self.tmp / "discovery")

    def register(self, i: int) -> None:
        body = {"instance_id": i + 1, "endpoint": f"tcp://127.0.0.1:{self.events[i]}",
                "replay_endpoint": f"tcp://127.0.0.1:{self.events[i] + 1}", "block_size": BLOCK,
                "model_name": "default"}
        httpx.post(f"http://127.0.0.1:{self.index_port}/register", json=body, timeout=10).raise_for_status()

    def unregister(self, i: int) -> None:
        httpx.post(f"http://127.0.0.1:{self.index_port}/unregister",
                   json={"instance_id": i + 1, "model_name": "default"}, timeout=10).raise_for_status()

    def _listed(self) -> bool:
        try:
            return len(self.client.models.list().data) == 1
        except openai.APIError:
            return False

    @staticmethod
    def _get(url: str):
        try:
            return httpx.get(url, timeout=10).json()
        except (httpx.HTTPError, json.JSONDecodeError):
            return None

    def _wait(self, ready, what: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return
            time.sleep(0.5)
        logs = "".join(f"--- {log.name}\n{log.read_text()[-2000:]}" for log in self.tmp.glob("*.log"))
        raise RuntimeError(f"{what} not ready in {timeout_s} s:\n{logs}")

    # ---- the two views ------------------------------------------------------------------

    def worker_blocks(self, i: int, flush: bool = False) -> dict[str, set]:
        return self._cache_blocks(i, flush)[1]

    def _cache_blocks(self, i: int, flush: bool = False) -> tuple[int, dict[str, set]]:
        answer = httpx.post(f"http://127.0.0.1:{self.system[i]}/engine/cache_blocks", json={"flush": flush},
                            timeout=60).json()
        return answer["worker_id"], {"device": set(answer["GPU"]), "host_pinned": set(answer["tier"])}

    def indexer_blocks(self) -> dict[int, dict[str, set]]:
        dump = self._get(f"http://127.0.0.1:{self.index_port}/dump") or {}
        return _tiers([entry for group in dump.values() for entry in group["events"]])

    def views_agree(self, settle_s: float = 15.0) -> tuple[bool, dict]:
        """Whether the router's view (Dynamo's KvRouter's, keyed by Dynamo's worker ids) and
        the standalone indexer's (keyed 1, 2 as registered) equal the workers' caches."""
        deadline = time.monotonic() + settle_s
        while True:
            listed = [self._cache_blocks(i) for i in range(2)]
            workers = {i + 1: blocks for i, (_, blocks) in enumerate(listed)}
            by_id = {wid: blocks for wid, blocks in listed}
            router, indexer = self.router.blocks(), self.indexer_blocks()
            agree = _held(router) == _held(by_id) and _held(indexer) == _held(workers)
            if agree or time.monotonic() > deadline:
                sizes = {f"worker {i + 1}": {t: (len(router.get(wid, {}).get(t, ())), len(indexer.get(i + 1, {}).get(t, ())),
                                                 len(blocks[t])) for t in blocks}
                         for i, (wid, blocks) in enumerate(listed)}
                sizes["workers in the router's view"] = len(_held(router))
                return agree, sizes
            time.sleep(0.5)

    def close(self) -> None:
        if getattr(self, "router", None) is not None:
            self.router.close()
        for proc in [*self.workers, *self.others]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in [*self.workers, *self.others]:
            if proc is not None:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


class RouterView:
    """Dynamo's own KV router (dynamo.llm.KvRouter) on the workers' endpoint, on a loop of its
    own in this process: it subscribes to the events the workers' KvEventPublishers relay on
    Dynamo's event plane, as the frontend's router does, and dump_events() lists its indexer."""

    def __init__(self, discovery: Path):
        os.environ["DYN_FILE_KV"] = str(discovery)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="router-view", daemon=True).start()
        self.router = self._call(self._start())

    def _call(self, coro, timeout_s: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self):
        from dynamo.llm import KvRouter, KvRouterConfig
        from dynamo.runtime import DistributedRuntime

        self.runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
        return KvRouter(self.runtime.endpoint(f"dyn://{ENDPOINT}"), BLOCK, KvRouterConfig())

    def blocks(self) -> dict[int, dict[str, set]]:
        """Dynamo worker id -> storage tier -> block names, as the router's indexer holds them."""
        dump = json.loads(self._call(self._dump()))
        return _tiers(dump if isinstance(dump, list) else [e for g in dump.values() for e in g["events"]])

    def close(self) -> None:
        try:
            self._call(self._stop(), 10)
        except Exception:  # noqa: BLE001 - the bench is over either way
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _dump(self) -> str:
        return await self.router.dump_events()

    async def _stop(self):
        self.runtime.shutdown()


def _held(view: dict[int, dict[str, set]]) -> dict[int, dict[str, set]]:
    """The view without empty tiers and workers (a flushed worker holds nothing)."""
    kept = {w: {t: b for t, b in tiers.items() if b} for w, tiers in view.items()}
    return {w: tiers for w, tiers in kept.items() if tiers}


def _tiers(events: list[dict]) -> dict[int, dict[str, set]]:
    view: dict[int, dict[str, set]] = {}
    for entry in events:
        stored = entry["event"]["data"].get("stored")
        tier = view.setdefault(entry["worker_id"], {"device": set(), "host_pinned": set()})
        tier.setdefault(entry["storage_tier"], set()).update(b["block_hash"] for b in stored["blocks"]) \
            if stored else None
    return view


def run_swarm(cluster: Cluster, args, tokenizer) -> dict:
    histories = [[{"role": "system", "content": system_prompt(a % args.systems)}] for a in range(args.agents)]
    seen: list[tuple[int | None, list[int]]] = []  # (the worker that served it, prompt + reply)
    rows: list[dict] = []
    errors = 0

    def turn(a: int, t: int):
        histories[a].append({"role": "user", "content": f"Agent {a}, turn {t}: a customer asks about "
                                                        f"{TOPICS[(a + t) % len(TOPICS)]}. What do I say?"})
        reply = cluster.client.chat.completions.create(model=MODEL, messages=histories[a], max_tokens=args.max_tokens,
                                                       temperature=0.0,
                                                       extra_body={"nvext": {"extra_fields": ["worker_id"]}})
        return a, reply

    order = list(range(args.agents))
    shuffle = random.Random(0).shuffle
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        for t in range(args.turns):
            shuffle(order)  # agents are not in lockstep (in order, round robin would keep each on one worker)
            for future in [pool.submit(turn, a, t) for a in order]:
                try:
                    a, reply = future.result()
                except openai.APIError:
                    errors += 1
                    continue
                tokens = tokenizer.apply_chat_template(histories[a], tokenize=True, add_generation_prompt=True)
                if not isinstance(tokens, list):
                    tokens = tokens["input_ids"]
                worker = ((getattr(reply, "nvext", None) or {}).get("worker_id") or {}).get("decode_worker_id")
                rows.append({"turn": t, "agent": a, "worker": worker,
                             "ideal": _reusable(tokens, [s for _, s in seen]),
                             "on_its_worker": _reusable(tokens, [s for w, s in seen if w == worker]),
                             "cached": reply.usage.prompt_tokens_details.cached_tokens or 0})
                text = reply.choices[0].message.content or ""
                histories[a].append({"role": "assistant", "content": text})
                seen.append((worker, tokens + tokenizer.encode(text, add_special_tokens=False)))
    cached, ideal = sum(r["cached"] for r in rows), sum(r["ideal"] for r in rows)
    by_turn = [{k: sum(r[k] for r in rows if r["turn"] == t) for k in ("ideal", "on_its_worker", "cached")}
               for t in range(args.turns)]
    return {"cached": cached, "ideal": ideal, "share": cached / ideal if ideal else 0.0, "errors": errors,
            "requests": args.agents * args.turns,
            "routing_loss": sum(r["ideal"] - r["on_its_worker"] for r in rows),
            "cache_loss": sum(r["on_its_worker"] - r["cached"] for r in rows),
            "rerouted": sum(r["on_its_worker"] < r["ideal"] for r in rows), "by_turn": by_turn}


def _reusable(tokens: list[int], earlier: list[list[int]]) -> int:
    """Whole blocks of the prompt (its last token always computed) one cache holding `earlier` serves."""
    best = max((_common(tokens, s) for s in earlier), default=0)
    return min(best, len(tokens) - 1) // BLOCK * BLOCK


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_views(cluster: Cluster) -> dict:
    out = {}
    out["the swarm"] = cluster.views_agree()
    filler, before = 0, sum(len(cluster.worker_blocks(i)["host_pinned"]) for i in range(2))
    demoted = before
    while demoted <= before and filler < 40:
        filler += 1  # unrelated long prompts fill a pool until more blocks are demoted to the tier
        cluster.client.completions.create(model=MODEL, max_tokens=1, temperature=0.0,
                                          prompt=f"Filler {filler}: " + " ".join(f"w{filler}x{j}" for j in range(400)))
        demoted = sum(len(cluster.worker_blocks(i)["host_pinned"]) for i in range(2))
    out["a tier demotion (blocks in the tier)"] = (cluster.views_agree()[0] and demoted > before,
                                                     {"tier blocks": (before, demoted), "filler prompts": filler})
    cluster.worker_blocks(0, flush=True)
    out["a flush of worker 1"] = cluster.views_agree()
    proc = cluster.workers[1]
    proc.terminate()
    proc.wait(timeout=60)
    cluster.unregister(1)
    cluster.start_worker(1)
    cluster.register(1)
    retried = 0
    for k in range(4):  # a little traffic after the restart (the frontend drops the gone instance first)
        for _ in range(60):
            try:
                cluster.client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0.0, messages=[
                    {"role": "system", "content": system_prompt(k)}, {"role": "user", "content": "After the restart."}])
                break
            except openai.APIStatusError as exc:
                if exc.status_code not in (404, 503):  # the model is briefly gone with its only instance
                    raise
                retried += 1
                time.sleep(1)
    out["a restart of worker 2"] = cluster.views_agree()
    out["a restart of worker 2"][1]["retries while the frontend dropped the old instance"] = retried
    return out


def report(mode: str, r: dict) -> None:
    print(f"--router-mode {mode:12s} reuse {r['cached']:6d} / ideal {r['ideal']:6d} tokens = "
          f"{100 * r['share']:5.1f}%   errors {r['errors']} of {r['requests']}   {r['seconds']} s")
    print(f"    lost to routing {r['routing_loss']} tokens ({r['rerouted']} requests away from their longest "
          f"prefix), to the worker's cache {r['cache_loss']}; by turn (ideal / on its worker / cached): "
          + ", ".join(f"{b['ideal']}/{b['on_its_worker']}/{b['cached']}" for b in r["by_turn"]), flush=True)


def main() -> None:
    parser = bench_parser(__doc__, quick="4 agents x 2 turns")
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--systems", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-blocks", type=int, default=160, help="each worker's pool (small: the swarm demotes)")
    parser.add_argument("--tier-bytes", type=int, default=256 << 20)
    parser.add_argument("--modes", default="kv,round-robin")
    parser.add_argument("--router-args", default=ROUTER_ARGS,
                        help=f"the kv run's extra frontend flags (default {ROUTER_ARGS!r}; '' for Dynamo's defaults)")
    args = parser.parse_args()
    apply_quick(parser, args, agents=4, turns=2)
    from transformers import AutoTokenizer

    from radixserve.model.default_model import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    results = {}
    print(f"{args.agents} agents x {args.turns} turns, {args.systems} shared system prompts, 2 workers of "
          f"{args.kv_blocks} pool blocks; kv run's frontend flags: {args.router_args or '(Dynamo defaults)'}",
          flush=True)
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"dynamo-swarm-{mode}-") as tmp:
            cluster = Cluster(mode, Path(tmp), args)
            try:
                cluster.start()
                start = time.monotonic()
                results[mode] = run_swarm(cluster, args, tokenizer)
                results[mode]["seconds"] = round(time.monotonic() - start, 1)
                report(mode, results[mode])
                if mode == "kv":
                    results["views"] = check_views(cluster)
            finally:
                cluster.close()
    if "kv" in results and "round-robin" in results:
        print(f"kv routing reached {100 * results['kv']['share']:.1f}% of ideal reuse against round robin's "
              f"{100 * results['round-robin']['share']:.1f}% (target >= 95%)")
    for what, (agree, sizes) in results.get("views", {}).items():
        print(f"router's view == workers' caches after {what}: {agree}  {sizes}")
    if args.json:
        write_json(args.json, {k: v for k, v in results.items() if k != "views"}, args)


if __name__ == "__main__":
    main()
