"""An agent swarm through NVIDIA Dynamo's frontend onto 2 radixserve workers (python -m
radixserve.dynamo), once with `--router-mode kv` (the router follows the workers' KV events)
and once with `round-robin`: 16 agents x 5 turns over 4 shared system prompts, each turn the
whole conversation re-sent (the frontend templates it). Printed: the share of the ideal reuse
each mode reached (prompt tokens served from a worker's cache / what one unbounded cache
would have served: each prompt's longest block-aligned prefix shared with an earlier prompt
and its reply), errors, and, in the kv run, whether the router's view (Dynamo's own indexer,
python -m dynamo.indexer, reading the same events) equals the workers' caches after the swarm,
a flush, a demotion to the second tier and a restart of one worker.

    python -m bench.bench_dynamo_swarm            # about 5 minutes on 2 cores
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

from bench.lib.cli import apply_quick, bench_parser, write_json

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16
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
        self.others.append(self._spawn("frontend", ["-m", "dynamo.frontend", "--router-mode", self.mode,
                                                    "--discovery-backend", "file", "--http-host", "127.0.0.1",
                                                    "--http-port", str(self.http)]))
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.http}/v1", api_key="x", max_retries=0,
                                    timeout=600)
        self._wait(self._listed, "frontend")
        if self.mode == "kv":
            self.others.append(self._spawn("indexer", ["-m", "dynamo.indexer", "--block-size", str(BLOCK),
                                                       "--port", str(self.index_port), "--threads", "1"]))
            self._wait(lambda: self._get(f"http://127.0.0.1:{self.index_port}/dump") is not None, "indexer")
            for i in range(2):
                self.register(i)

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
        answer = httpx.post(f"http://127.0.0.1:{self.system[i]}/engine/cache_blocks", json={"flush": flush},
                            timeout=60).json()
        return {"device": set(answer["GPU"]), "host_pinned": set(answer["tier"])}

    def router_blocks(self) -> dict[int, dict[str, set]]:
        dump = self._get(f"http://127.0.0.1:{self.index_port}/dump") or {}
        view: dict[int, dict[str, set]] = {1: {"device": set(), "host_pinned": set()},
                                           2: {"device": set(), "host_pinned": set()}}
        for group in dump.values():
            for entry in group["events"]:
                stored = entry["event"]["data"].get("stored")
                tier = view[entry["worker_id"]].setdefault(entry["storage_tier"], set())
                tier.update(b["block_hash"] for b in stored["blocks"]) if stored else None
        return view

    def views_agree(self, settle_s: float = 15.0) -> tuple[bool, dict]:
        deadline = time.monotonic() + settle_s
        while True:
            workers = {i + 1: self.worker_blocks(i) for i in range(2)}
            router = self.router_blocks()
            if router == workers or time.monotonic() > deadline:
                sizes = {w: {t: (len(router[w].get(t, ())), len(workers[w][t])) for t in workers[w]} for w in workers}
                return router == workers, sizes
            time.sleep(0.5)

    def close(self) -> None:
        for proc in [*self.workers, *self.others]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in [*self.workers, *self.others]:
            if proc is not None:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def run_swarm(cluster: Cluster, args, tokenizer) -> dict:
    histories = [[{"role": "system", "content": system_prompt(a % args.systems)}] for a in range(args.agents)]
    seen: list[list[int]] = []
    cached = ideal = errors = 0

    def turn(a: int, t: int):
        histories[a].append({"role": "user", "content": f"Agent {a}, turn {t}: a customer asks about "
                                                        f"{TOPICS[(a + t) % len(TOPICS)]}. What do I say?"})
        reply = cluster.client.chat.completions.create(model=MODEL, messages=histories[a], max_tokens=args.max_tokens,
                                                       temperature=0.0)
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
                best = max((_common(tokens, s) for s in seen), default=0)
                ideal += min(best, len(tokens) - 1) // BLOCK * BLOCK
                cached += reply.usage.prompt_tokens_details.cached_tokens or 0
                text = reply.choices[0].message.content or ""
                histories[a].append({"role": "assistant", "content": text})
                seen.append(tokens + tokenizer.encode(text, add_special_tokens=False))
    return {"cached": cached, "ideal": ideal, "share": cached / ideal if ideal else 0.0, "errors": errors,
            "requests": args.agents * args.turns}


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
    filler = 0
    while sum(len(cluster.worker_blocks(i)["host_pinned"]) for i in range(2)) == 0 and filler < 40:
        filler += 1  # unrelated long prompts fill a pool until blocks are demoted to the tier
        cluster.client.completions.create(model=MODEL, max_tokens=1, temperature=0.0,
                                          prompt=f"Filler {filler}: " + " ".join(f"w{filler}x{j}" for j in range(400)))
    demoted = sum(len(cluster.worker_blocks(i)["host_pinned"]) for i in range(2))
    out["a tier demotion (blocks in the tier)"] = (cluster.views_agree()[0] and demoted > 0,
                                                     {"tier blocks": demoted, "filler prompts": filler})
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
    args = parser.parse_args()
    apply_quick(parser, args, agents=4, turns=2)
    from transformers import AutoTokenizer

    from radixserve.model.default_model import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    results = {}
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"dynamo-swarm-{mode}-") as tmp:
            cluster = Cluster(mode, Path(tmp), args)
            try:
                cluster.start()
                start = time.monotonic()
                results[mode] = run_swarm(cluster, args, tokenizer)
                results[mode]["seconds"] = round(time.monotonic() - start, 1)
                if mode == "kv":
                    results["views"] = check_views(cluster)
            finally:
                cluster.close()
    for mode in args.modes.split(","):
        r = results[mode]
        print(f"--router-mode {mode:12s} reuse {r['cached']:6d} / ideal {r['ideal']:6d} tokens = "
              f"{100 * r['share']:5.1f}%   errors {r['errors']} of {r['requests']}   {r['seconds']} s")
    for what, (agree, sizes) in results.get("views", {}).items():
        print(f"router's view == workers' caches after {what}: {agree}  {sizes}")
    if args.json:
        write_json(args.json, {k: v for k, v in results.items() if k != "views"}, args)


if __name__ == "__main__":
    main()
