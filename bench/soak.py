"""A soak of one `radixserve serve` (issue 29, point 3): every route, two API keys, for a
bounded time on loopback, at a rate that keeps the engine busy.

Workers of key A and key B each loop over a weighted mix: chat with tools (the openai
client), completions, the Responses API (chains through previous_response_id), /generate
with rids (some aborted), the Anthropic route where the server has it, streams the client
drops half way, bad inputs, flushes of the key's own cache, sessions opened and closed,
pins, prompts that share a prefix and prompts that share nothing. A prober tries every id
key A made with key B's credentials (stored responses, rids, sessions) and must be refused.

Afterwards the server must be idle and intact (`/debug/check_integrity`, free + cached
blocks == the pool), its RSS within `--rss-bound` of its value after the warm-up (the first
fifth of the run: of its minutes, or of its calls with --calls) at every sample after it and at the end, its
threads and file descriptors no more than a few above it, every accepted request answered
or refused with a clear error (a JSON error body, never a dropped connection or a 500), and
no answer to key B holding key A's secret word (nor A's to B). Prints the figures, writes
them as JSON (--json) and can plot RSS over time (--plot).

    .venv/bin/python -m bench.soak --minutes 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import openai

from bench.lib.servers import served
from bench.lib.cli import apply_quick, bench_parser, write_json

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"A": "soak-key-a", "B": "soak-key-b"}
ADMIN = "soak-admin"
SECRETS = {"A": "Quokka7731", "B": "Narwhal5519"}  # words only that key's prompts carry
SYSTEM = ("You are a careful assistant for a logistics company. You answer briefly, you use the tools when a "
          "question needs live data, and you never invent shipment numbers. ") * 3
TOOLS = [{"type": "function", "function": {
    "name": "track_shipment", "description": "Where a shipment is now",
    "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}}]
WORDS = "river stone lamp quiet orbit maple signal harbor copper violet meadow engine".split()


@dataclass
class Tally:
    """What every worker saw, under one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: Counter = field(default_factory=Counter)  # (action, "ok" | "refused 4xx" | ...)
    failures: list[str] = field(default_factory=list)  # an accepted request without an answer or clear error
    leaks: list[str] = field(default_factory=list)  # one key saw the other's text or ids
    made: dict[str, list[str]] = field(default_factory=lambda: {"responses": [], "rids": [], "sessions": []})

    def note(self, action: str, outcome: str) -> None:
        with self.lock:
            self.outcomes[(action, outcome)] += 1

    def fail(self, message: str) -> None:
        with self.lock:
            self.failures.append(message)

    def calls(self) -> int:
        with self.lock:
            return sum(self.outcomes.values())


class Worker:
    def __init__(self, url: str, key: str, tally: Tally, rng: random.Random, anthropic: bool):
        self.url, self.key, self.tally, self.rng = url, key, tally, rng
        self.headers = {"Authorization": f"Bearer {KEYS[key]}"}
        self.http = httpx.Client(base_url=url, headers=self.headers, timeout=120)
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=KEYS[key], timeout=120, max_retries=0)
        self.other = "B" if key == "A" else "A"
        self.last_response: str | None = None
        self.session = f"agent-{key}-{rng.randrange(10**6)}"
        self.actions = [
            (self.chat_with_tools, 3), (self.completion, 3), (self.responses_chain, 2), (self.generate_rid, 2),
            (self.dropped_stream, 2), (self.bad_input, 2), (self.flush_own, 1), (self.session_turn, 2),
            (self.pin, 1), (self.unshared, 2),
        ]
        if anthropic:
            self.actions.append((self.anthropic_message, 2))

    # ---- the mix ----------------------------------------------------------------------

    def step(self) -> None:
        action = self.rng.choices([a for a, _ in self.actions], [w for _, w in self.actions])[0]
        try:
            action()
        except (httpx.HTTPError, openai.APIConnectionError, openai.APITimeoutError) as exc:
            self.tally.fail(f"{self.key} {action.__name__}: no answer: {type(exc).__name__}: {exc}")
        except openai.APIStatusError as exc:
            self._judge(action.__name__, exc.status_code, exc.response.text)

    def chat_with_tools(self) -> None:
        out = self.client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": f"{SECRETS[self.key]}: where is shipment "
                                                                f"{self.rng.randrange(1000)}?"}],
            tools=TOOLS, max_tokens=self.rng.randrange(4, 24), temperature=0.7,
            stream=self.rng.random() < 0.3)
        if isinstance(out, openai.Stream):
            text = "".join(c.choices[0].delta.content or "" for c in out if c.choices)
        else:
            text = out.choices[0].message.content or ""
        self._check_text("chat", text)

    def completion(self) -> None:
        out = self.client.completions.create(model=MODEL, prompt=SYSTEM + f"Note {SECRETS[self.key]}: ",
                                             max_tokens=self.rng.randrange(2, 16))
        self._check_text("completion", out.choices[0].text)

    def responses_chain(self) -> None:
        previous = self.last_response if self.rng.random() < 0.6 else None
        out = self.client.responses.create(model=MODEL, input=f"{SECRETS[self.key]} says hi", max_output_tokens=8,
                                           previous_response_id=previous)
        self.last_response = out.id
        self._check_text("responses", out.output_text)
        if self.key == "A":
            self._made("responses", out.id)

    def generate_rid(self) -> None:
        rid = f"{self.key}-{self.rng.randrange(10**9)}"
        body = {"text": SYSTEM + SECRETS[self.key], "rid": rid,
                "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0.5}}
        if self.key == "A":
            self._made("rids", rid)
        abort = self.rng.random() < 0.4
        if abort:
            timer = threading.Timer(self.rng.uniform(0.05, 1.0), lambda: self.http.post(
                "/abort_request", json={"rid": rid}))
            timer.start()
        answer = self.http.post("/generate", json=body)
        self._judge("generate", answer.status_code, answer.text)
        if answer.status_code == 200:
            meta = answer.json()["meta_info"]
            if meta["id"] != rid:
                self.tally.fail(f"{self.key} generate: answered rid {meta['id']!r} for {rid!r}")
            if meta["finish_reason"]["type"] == "abort" and not abort:
                self.tally.fail(f"{self.key} generate: {rid} aborted, but not by its own key")
            self._check_text("generate", answer.json()["text"], count=False)
        if abort:
            timer.join()

    def dropped_stream(self) -> None:
        body = {"model": MODEL, "prompt": SYSTEM, "max_tokens": 200, "stream": True}
        with self.http.stream("POST", "/v1/completions", json=body) as answer:
            self._judge("dropped_stream", answer.status_code, "")
            for _ in zip(range(self.rng.randrange(1, 6)), answer.iter_lines()):
                pass
        self.tally.note("dropped_stream", "dropped by the client")

    def bad_input(self) -> None:
        bad = self.rng.choice([
            ("/v1/chat/completions", {"model": MODEL, "messages": [], "max_tokens": 2}),
            ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -3}),
            ("/generate", {"text": "x", "sampling_params": {"temperature": "hot"}}),
            ("/v1/responses", {"model": MODEL, "input": "x", "background": True}),
            ("/v1/chat/completions", b"{not json"),
        ])
        path, body = bad
        answer = self.http.post(path, content=body) if isinstance(body, bytes) else self.http.post(path, json=body)
        if not 400 <= answer.status_code < 500 or "error" not in answer.json():
            self.tally.fail(f"{self.key} bad input to {path}: {answer.status_code} {answer.text[:200]}")
        self.tally.note("bad_input", f"refused {answer.status_code}")

    def flush_own(self) -> None:
        answer = self.http.post("/flush_cache")
        self._judge("flush", answer.status_code, answer.text)

    def session_turn(self) -> None:
        body = {"text": SYSTEM + f"{SECRETS[self.key]} turn", "session_id": self.session,
                "sampling_params": {"max_new_tokens": 4}}
        answer = self.http.post("/generate", json=body)
        self._judge("session", answer.status_code, answer.text)
        if self.key == "A":
            self._made("sessions", self.session)
        if self.rng.random() < 0.3:
            closed = self.http.post(f"/v1/sessions/{self.session}/close")
            self._judge("session_close", closed.status_code, closed.text)
            self.session = f"agent-{self.key}-{self.rng.randrange(10**6)}"

    def pin(self) -> None:
        answer = self.http.post("/v1/sessions/pin", json={"text": SYSTEM, "ttl_s": 5})
        self._judge("pin", answer.status_code, answer.text)

    def unshared(self) -> None:
        words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randrange(20, 120)))
        out = self.client.completions.create(model=MODEL, prompt=words, max_tokens=8)
        self._check_text("unshared", out.choices[0].text)

    def anthropic_message(self) -> None:
        body = {"model": MODEL, "max_tokens": 12, "system": SYSTEM,
                "messages": [{"role": "user", "content": f"{SECRETS[self.key]}: hello"}],
                "stream": self.rng.random() < 0.3}
        answer = self.http.post("/v1/messages", json=body, headers={"x-api-key": KEYS[self.key]})
        self._judge("anthropic", answer.status_code, answer.text)
        self._check_text("anthropic", answer.text, count=False)

    # ---- checks -----------------------------------------------------------------------

    def _judge(self, action: str, status: int, text: str) -> None:
        if status == 200:
            self.tally.note(action, "ok")
            return
        clear = 400 <= status < 500 or status == 503
        try:
            clear = clear and "error" in json.loads(text)
        except ValueError:
            clear = clear and not text  # a stream's status alone
        self.tally.note(action, f"refused {status}")
        if not clear:
            self.tally.fail(f"{self.key} {action}: {status} {text[:200]}")

    def _check_text(self, action: str, text: str, count: bool = True) -> None:
        if count:
            self.tally.note(action, "ok")
        if SECRETS[self.other] in text:
            with self.tally.lock:
                self.tally.leaks.append(f"{self.key} saw {self.other}'s secret in a {action} answer")

    def _made(self, kind: str, ident: str) -> None:
        with self.tally.lock:
            self.tally.made[kind] = (self.tally.made[kind] + [ident])[-50:]


def probe_foreign_ids(url: str, tally: Tally, rng: random.Random) -> None:
    """Key B names what key A made: each must look as if it did not exist."""
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEYS['B']}"}, timeout=120)
    with tally.lock:
        made = {k: list(v) for k, v in tally.made.items()}
    if made["responses"]:
        answer = http.post("/v1/responses", json={"model": MODEL, "input": "go on", "max_output_tokens": 2,
                                                  "previous_response_id": rng.choice(made["responses"])})
        _expect_refused(tally, "foreign response id", answer, 404)
    if made["rids"]:
        answer = http.post("/abort_request", json={"rid": rng.choice(made["rids"])})
        if answer.status_code != 200 or answer.json() != {"aborted": 0}:
            tally.leaks.append(f"B aborted A's rid: {answer.text[:200]}")
        tally.note("foreign rid", "refused")
    if made["sessions"]:
        answer = http.post(f"/v1/sessions/{rng.choice(made['sessions'])}/close")
        _expect_refused(tally, "foreign session", answer, 404)


def _expect_refused(tally: Tally, what: str, answer: httpx.Response, status: int) -> None:
    if answer.status_code != status:
        with tally.lock:
            tally.leaks.append(f"{what}: {answer.status_code} {answer.text[:200]}")
    tally.note(what, f"refused {answer.status_code}")


def process_figures(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return {"rss": rss, "threads": len(os.listdir(f"/proc/{pid}/task")), "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def run(args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "radixserve", "serve", "--api-key", KEYS["A"], "--api-key", KEYS["B"],
               "--admin-api-key", ADMIN, "--enable-debug-endpoints", "--num-kv-blocks", str(args.kv_blocks),
               "--log-level", "warning", *shlex.split(args.serve_args)]
    tally, rng = Tally(), random.Random(args.seed)
    with served(command) as url:
        pid = _server_pid(url)
        anthropic = "/v1/messages" in httpx.get(url + "/openapi.json", headers={
            "Authorization": f"Bearer {ADMIN}"}).json()["paths"]
        deadline = time.monotonic() + args.minutes * 60
        warmup_s = args.minutes * 60 / 5  # 2 of 10 minutes: the bound holds over the last 8
        stop = threading.Event()  # set at --calls calls (if given), else the minutes end the run
        workers = [Worker(url, key, tally, random.Random(args.seed * 100 + i), anthropic)
                   for i, key in enumerate(["A", "B"] * (args.workers // 2))]

        def loop(worker: Worker) -> None:
            while not stop.is_set() and time.monotonic() < deadline:
                worker.step()
                if args.calls and tally.calls() >= args.calls:
                    stop.set()

        threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in workers]
        for t in threads:
            t.start()
        started, samples, warm = time.monotonic(), [], None
        while time.monotonic() < deadline and not stop.is_set():
            stop.wait(min(5.0, max(0.0, deadline - time.monotonic())))
            probe_foreign_ids(url, tally, rng)
            elapsed = time.monotonic() - started
            samples.append((elapsed, process_figures(pid)))
            if warm is None and (tally.calls() >= args.calls / 5 if args.calls else elapsed >= warmup_s):
                warm, warmup_s = samples[-1][1], elapsed  # the bound holds from this sample on
            if len(samples) % 6 == 0:
                done = sum(n for (_, o), n in tally.outcomes.items())
                print(f"  {elapsed:6.0f} s  {done} calls  rss {samples[-1][1]['rss'] / 2**20:.0f} MiB  "
                      f"failures {len(tally.failures)}  leaks {len(tally.leaks)}", file=sys.stderr, flush=True)
        stop.set()
        for t in threads:
            t.join(180)
        time.sleep(2.0)  # let dropped streams' aborts settle
        admin = {"Authorization": f"Bearer {ADMIN}"}
        check = httpx.post(url + "/debug/check_integrity", headers=admin, timeout=120).json()
        stats = check["stats"]
        idle = process_figures(pid)
    warm = warm or samples[0][1]
    return {
        "minutes": args.minutes, "workers": args.workers, "serve_args": args.serve_args, "calls": sum(tally.outcomes.values()),
        "outcomes": {f"{a}: {o}": n for (a, o), n in sorted(tally.outcomes.items())},
        "failures": tally.failures, "leaks": tally.leaks,
        "integrity_ok": bool(check.get("ok")), "idle": stats["running"] == 0 and stats["waiting"] == 0,
        "blocks": {k: stats[k] for k in ("blocks_total", "blocks_free", "blocks_cached")},
        "warm": warm, "end": idle, "rss_bound": args.rss_bound, "warmup_s": warmup_s,
        "rss_samples": [(t, f["rss"]) for t, f in samples],
    }


def _server_pid(url: str) -> int:
    port = int(url.rsplit(":", 1)[1])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and str(port).encode() in argv:
            return int(pid)
    raise SystemExit("cannot find the server's process")


def verdict(report: dict) -> list[str]:
    """What failed (empty: the soak held)."""
    problems = [f"no answer or unclear error: {f}" for f in report["failures"][:20]]
    problems += [f"leak: {leak}" for leak in report["leaks"][:20]]
    blocks = report["blocks"]
    if not report["integrity_ok"] or not report["idle"]:
        problems.append("the server is not idle and intact after the soak")
    if blocks["blocks_free"] + blocks["blocks_cached"] != blocks["blocks_total"]:
        problems.append(f"free + cached blocks != the pool: {blocks}")
    warm, end = report["warm"], report["end"]
    peak = _peak_after_warmup(report)
    if max(end["rss"], peak) > warm["rss"] * (1 + report["rss_bound"]):
        problems.append(f"RSS grew from {warm['rss'] >> 20} to {end['rss'] >> 20} MiB at the end, "
                        f"{peak >> 20} MiB at most after the warm-up (bound {report['rss_bound']:.0%})")
    for kind, slack in (("threads", 4), ("fds", 8)):
        if end[kind] > warm[kind] + slack:
            problems.append(f"{kind} grew from {warm[kind]} to {end[kind]}")
    return problems


def _peak_after_warmup(report: dict) -> int:
    """The largest RSS sampled from the end of the warm-up on."""
    after = [rss for t, rss in report["rss_samples"] if t >= report["warmup_s"]]
    return max(after, default=report["end"]["rss"])


def print_report(report: dict, problems: list[str]) -> None:
    warm, end = report["warm"], report["end"]
    extra = f" {report['serve_args']}" if report.get("serve_args") else ""
    print(f"soak: one `radixserve serve{extra}` (default model, 2 keys + admin), {report['workers']} workers, "
          f"{report['minutes']} min, every route; {report['calls']} calls")
    for name, count in report["outcomes"].items():
        print(f"  {name:40s} {count}")
    print(f"  blocks after: {report['blocks']}")
    peak = _peak_after_warmup(report)
    print(f"  RSS after warm-up {warm['rss'] / 2**20:.0f} MiB -> at most {peak / 2**20:.0f} MiB after it "
          f"({peak / warm['rss']:.3f}x), at the end {end['rss'] / 2**20:.0f} MiB ({end['rss'] / warm['rss']:.3f}x; "
          f"bound {1 + report['rss_bound']:.2f}x)")
    print(f"  threads {warm['threads']} -> {end['threads']}, fds {warm['fds']} -> {end['fds']}")
    print("held" if not problems else "FAILED:\n  " + "\n  ".join(problems))


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick="2 minutes", plot="write RSS over time as a PNG here",
                          json_help="write the report as JSON here")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--calls", type=int, default=0, help="stop once this many calls are done (the minutes "
                        "still bound the run); the warm-up is then the first fifth of the calls")
    parser.add_argument("--workers", type=int, default=6, help="client threads, half per key")
    parser.add_argument("--kv-blocks", type=int, default=384, help="a small pool, so eviction runs all the time")
    parser.add_argument("--rss-bound", type=float, default=0.05, help="allowed RSS growth after the warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-args", default="", help="more arguments for `radixserve serve`, one string "
                        "(e.g. --serve-args='--weight-dtype float32': the float32 weights' oneDNN path)")
    parser.add_argument("--out", dest="json", help=argparse.SUPPRESS)  # --json's earlier name
    args = parser.parse_args(argv)
    apply_quick(parser, args, minutes=2.0)
    report = run(args)
    problems = verdict(report)
    print_report(report, problems)
    if args.json:
        write_json(args.json, {**report, "problems": problems})
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        times, rss = zip(*report["rss_samples"])
        plt.plot(times, [r / 2**20 for r in rss])
        plt.xlabel("s")
        plt.ylabel("server RSS (MiB)")
        plt.title("radixserve soak")
        plt.savefig(args.plot)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
