"""Agents' real conditions: CPU-bound neighbours, re-rendered turns, few-shot questions on a long prefix.

    python -m bench.bench_agent_conditions [--parts contention,reuse] [--models default,gemma3-270m]
        [--llama-server PATH]  (or LLAMA_SERVER=PATH)  [--quick] [--json F] [--plot F]

Two workloads, through the official openai client against a served model:
- chat agents: N agents share one long system prompt (~1.5k tokens); each runs T turns, a new user
  message each turn and the previous replies appended as assistant messages, so the server renders
  the whole conversation again every turn; temperature 0, 24-token replies; the first agent runs
  alone, then the others at once;
- few-shot: Q questions on one few-shot block longer than two of Gemma 3's 512-token windows, four
  at a time, 8-token answers.

Parts:
- contention: each workload quiet and beside one and two CPU-bound processes (busy loops), for
  radixserve as it is (its steps' team sized to the cores it gets) and with the team fixed at every
  core (`--num-threads`, the behaviour before); with steps, time per phase and the wall of each run.
  Target: beside one CPU-bound process, wall <= 2.5x the quiet wall.
- reuse: on Gemma 3 (sliding-window layers), hybrid KV on (the default), off, int8 KV, and a KV
  budget of half the working set, against llama.cpp's server on the same file. Share of ideal reuse
  (ideal: each prompt's longest common prefix with an earlier prompt and its reply, the prompt's last
  token aside), wall, greedy answers equal to hybrid off, KV bytes held at the peak. Targets: hybrid
  on wall <= 1.2x hybrid off's and <= 0.25x llama.cpp's, >= 95% of ideal reuse (>= 90% at half
  budget), KV bytes held <= 0.5x hybrid off's.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from bench.lib.cli import Figures, apply_quick, bench_parser
from bench.lib.peers import add_llama_server, gguf_path
from bench.lib.servers import debug_stats, keyless_env, metrics, radixserve_command, served_process

GEMMA = "gemma3-270m"
GEMMA_TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "tests", "templates", "gemma3.jinja")
_WORDS = ("pallet route depot driver invoice order delay north south truck customer window callback status "
          "function test branch commit review error module import value return string config deploy train "
          "station ticket platform change price hour minute city budget hotel seat booking confirmed").split()


# ---- workloads ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatAgents:
    agents: int = 6
    turns: int = 5
    system_words: int = 1100  # ~1.5k tokens with the template
    reply_tokens: int = 24
    name: str = "chat-agents"

    def describe(self) -> str:
        return (f"chat agents: {self.agents} x {self.turns} turns, one ~{self.system_words}-word system prompt, "
                f"{self.reply_tokens}-token replies appended, the first agent alone then the rest at once")

    def run(self, client: "Client") -> None:
        system = "You are a careful operations agent. Notes: " + _words(0, self.system_words)
        client.run_agent(self, system, 0)
        with ThreadPoolExecutor(max(1, self.agents - 1)) as pool:
            list(pool.map(lambda i: client.run_agent(self, system, i), range(1, self.agents)))


@dataclass(frozen=True)
class FewShot:
    questions: int = 24
    examples: int = 40  # ~1.4k tokens: past two 512-token windows
    answer_tokens: int = 8
    concurrency: int = 4
    name: str = "few-shot"

    def describe(self) -> str:
        return (f"few-shot: {self.questions} questions on one {self.examples}-example block, "
                f"{self.concurrency} at a time, {self.answer_tokens}-token answers")

    def run(self, client: "Client") -> None:
        rng = random.Random(7)
        shots = "\n".join(f"Ticket: {_words(i, 12)}\nTeam: {rng.choice(['billing', 'tech', 'sales'])}"
                          for i in range(self.examples))
        system = "Sort each support ticket into a team.\n" + shots
        questions = [f"Ticket: {_words(1000 + q, 14)}\nTeam:" for q in range(self.questions)]
        with ThreadPoolExecutor(self.concurrency) as pool:
            list(pool.map(lambda q: client.ask(system, questions[q], self.answer_tokens, key=q), range(len(questions))))


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


# ---- a client that records what a perfect cache would have reused -------------------------------

@dataclass
class RunRecord:
    wall_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ideal_tokens: int = 0
    answers: dict[str, str] = field(default_factory=dict)
    server: dict[str, float] = field(default_factory=dict)  # steps and seconds per phase, KV held, ...

    @property
    def reuse(self) -> float:
        return self.cached_tokens / self.ideal_tokens if self.ideal_tokens else float("nan")


class Client:
    """The openai client against one server, recording usage, answers and the ideal reuse."""

    def __init__(self, url: str, model: str, token_ids: bool):
        from openai import OpenAI

        self.client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=900, max_retries=0)
        self.model, self.token_ids = model, token_ids
        self.record = RunRecord()
        self._seen: list[list[int]] = []  # finished prompts + replies, as token ids
        self._lock = threading.Lock()

    def run_agent(self, workload: ChatAgents, system: str, agent: int) -> None:
        messages = [{"role": "system", "content": system}]
        for turn in range(workload.turns):
            messages.append({"role": "user", "content": f"[agent {agent}, turn {turn}] {_words(agent * 97 + turn, 40)}"
                                                        f"\nWhat should happen next?"})
            text = self._chat(messages, workload.reply_tokens, f"agent{agent}/turn{turn}")
            messages.append({"role": "assistant", "content": text})

    def ask(self, system: str, question: str, max_tokens: int, key: int) -> None:
        self._chat([{"role": "system", "content": system}, {"role": "user", "content": question}], max_tokens,
                   f"question{key}")

    def _chat(self, messages: list[dict], max_tokens: int, key: str) -> str:
        with self._lock:
            seen = list(self._seen)  # what had finished when this request was sent
        extra = {"return_token_ids": True} if self.token_ids else {}
        out = self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, extra_body=extra)
        text = out.choices[0].message.content or ""
        usage = out.usage
        cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
        with self._lock:
            self.record.prompt_tokens += usage.prompt_tokens
            self.record.cached_tokens += cached
            self.record.answers[key] = text
            if self.token_ids:
                prompt = list(getattr(out, "prompt_token_ids", None) or [])
                reply = list(getattr(out.choices[0], "token_ids", None) or [])
                self.record.ideal_tokens += ideal_reuse(prompt, seen)
                self._seen.append(prompt + reply)
        return text


def ideal_reuse(prompt: list[int], seen: list[list[int]]) -> int:
    """The longest common prefix of `prompt` with anything seen, its last token aside."""
    best = 0
    for earlier in seen:
        n = 0
        for a, b in zip(prompt, earlier):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return min(best, max(0, len(prompt) - 1))


# ---- neighbours and servers ----------------------------------------------------------------------

@contextlib.contextmanager
def neighbours(count: int):
    """`count` CPU-bound processes (busy loops) for the duration."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


@dataclass(frozen=True)
class System:
    name: str
    kind: str  # radixserve | llama
    args: tuple[str, ...] = ()


def serve(system: System, model: str, llama_server: str | None, log):
    if system.kind == "llama":
        gguf = gguf_path(model)
        command = [llama_server, "-m", gguf, "--host", "127.0.0.1", "-np", "6", "-c", str(6 * 4096), "--jinja",
                   "-t", str(len(os.sched_getaffinity(0))), "--alias", "m"]
        if model == GEMMA:
            command += ["--chat-template-file", GEMMA_TEMPLATE]
        return served_process(command + list(system.args), stdout=log, stderr=subprocess.STDOUT)
    command = radixserve_command("--enable-debug-endpoints")
    if model != "default":
        command += ["--model", model]
    if model == GEMMA:
        command += ["--chat-template", GEMMA_TEMPLATE]
    return served_process(command + list(system.args), keyless_env(), stdout=log, stderr=subprocess.STDOUT)


class PeakKV(threading.Thread):
    """Polls /metrics for the KV bytes held (blocks and window pages in use) and keeps the peak."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.peak, self.done = url, 0, threading.Event()
        m = metrics(url)
        self.block_bytes = m.get("radixserve_kv_bytes_per_token", 0) * 16
        self.page_bytes = debug_stats(url).get("window_page_bytes", 0)  # a hybrid KV engine's window page

    def run(self) -> None:
        while not self.done.wait(0.25):
            with contextlib.suppress(httpx.HTTPError):
                m = metrics(self.url)
                used = m["radixserve_kv_blocks_total"] - m["radixserve_kv_blocks_free"]
                held = used * self.block_bytes + m.get("radixserve_kv_window_pages_attached", 0) * self.page_bytes
                self.peak = max(self.peak, int(held))


def run_once(system: System, model: str, workload, busy: int, llama_server: str | None) -> RunRecord:
    with tempfile.TemporaryFile() as log:
        try:
            with serve(system, model, llama_server, log) as (url, _process):
                client = Client(url, "m", token_ids=system.kind == "radixserve")
                client.ask("Warm-up.", "Say hi.", 2, key=-1)  # loads and JIT-compiles outside the timing
                if system.kind == "radixserve":
                    httpx.post(url + "/flush_cache", timeout=60)
                client.record = RunRecord()
                client._seen.clear()
                before = debug_stats(url)
                peak = PeakKV(url) if system.kind == "radixserve" else None
                if peak:
                    peak.start()
                with neighbours(busy):
                    t0 = time.perf_counter()
                    workload.run(client)
                    client.record.wall_s = time.perf_counter() - t0
                if peak:
                    peak.done.set()
                    peak.join()
                after = debug_stats(url)
                record = client.record
                for key in ("steps", "schedule_s", "model_s", "postprocess_s", "computed_tokens"):
                    if key in after:
                        record.server[key] = after[key] - before.get(key, 0)
                record.server["kv_peak_held_bytes"] = peak.peak if peak else 0
                record.server["threads_end"] = after.get("cpu_threads", 0)
                record.server["team_reductions"] = after.get("cpu_team_reductions", 0)
                return record
        except BaseException:
            log.seek(0)
            print(f"{system.name}: its log ends:\n" + log.read()[-3000:].decode(errors="replace"), file=sys.stderr)
            raise


# ---- parts ------------------------------------------------------------------------------------------

def contention(args, workloads, figures: Figures) -> list[str]:
    cores = len(os.sched_getaffinity(0))
    systems = [System("radixserve", "radixserve"), System(f"fixed team ({cores})", "radixserve",
                                                           ("--num-threads", str(cores)))]
    if args.llama_server:
        systems.append(System("llama.cpp", "llama"))
    verdicts = []
    for model in args.models.split(","):
        for workload in workloads:
            print(f"\n== contention: {model}, {workload.describe()}")
            print(f"{'system':<22}{'busy':>5}{'wall s':>9}{'x quiet':>9}{'steps':>7}{'sched s':>9}{'model s':>9}"
                  f"{'post s':>8}{'threads':>8}")
            for system in systems:
                quiet = None
                for busy in args.busy:
                    r = run_once(system, model, workload, busy, args.llama_server)
                    quiet = quiet or r.wall_s
                    s = r.server
                    print(f"{system.name:<22}{busy:>5}{r.wall_s:>9.1f}{r.wall_s / quiet:>8.2f}x"
                          f"{int(s.get('steps', 0)):>7}{s.get('schedule_s', 0):>9.2f}{s.get('model_s', 0):>9.2f}"
                          f"{s.get('postprocess_s', 0):>8.2f}{int(s.get('threads_end', 0)):>8}", flush=True)
                    figures.add(f"{model} {type(workload).__name__} busy={busy}", system.name, r.wall_s)
                    if busy == 1 and system.name == "radixserve":
                        ok = r.wall_s / quiet <= 2.5
                        verdicts.append(f"{model}, {type(workload).__name__}: beside one CPU-bound process "
                                        f"{r.wall_s / quiet:.2f}x the quiet wall (target <= 2.5x) "
                                        f"[{'met' if ok else 'MISSED'}]")
    return verdicts


def reuse(args, workloads, figures: Figures) -> list[str]:
    verdicts = []
    systems = [System("hybrid off", "radixserve", ("--hybrid-kv", "off")), System("hybrid on", "radixserve"),
               System("hybrid on, int8 KV", "radixserve", ("--kv-cache-dtype", "int8"))]
    for workload in workloads:
        print(f"\n== reuse: {GEMMA}, {workload.describe()}")
        records: dict[str, RunRecord] = {}
        runs = list(systems)
        half = _half_budget_system(workload)
        if half is not None:
            runs.append(half)
        if args.llama_server:
            runs.append(System("llama.cpp", "llama"))
        print(f"{'system':<24}{'wall s':>8}{'prompt':>8}{'cached':>8}{'ideal':>8}{'of ideal':>9}{'KV held MiB':>12}"
              f"{'answers = off':>14}")
        for system in runs:
            r = run_once(system, GEMMA, workload, 0, args.llama_server)
            records[system.name] = r
            off = records.get("hybrid off")
            same = "-" if system.kind == "llama" or off is None else (
                f"{sum(off.answers[k] == v for k, v in r.answers.items())}/{len(r.answers)}")
            ideal = f"{r.reuse:>8.1%}" if r.ideal_tokens else f"{'-':>8}"
            print(f"{system.name:<24}{r.wall_s:>8.1f}{r.prompt_tokens:>8}{r.cached_tokens:>8}{r.ideal_tokens:>8}"
                  f"{ideal:>9}{r.server.get('kv_peak_held_bytes', 0) / 2**20:>12.1f}{same:>14}", flush=True)
            figures.add(f"{type(workload).__name__} wall", system.name, r.wall_s)
        verdicts += _reuse_verdicts(type(workload).__name__, records)
    return verdicts


def _half_budget_system(workload) -> System | None:
    """Hybrid on with the KV budget at half the working set (Gemma 3's float32 KV bytes)."""
    token_bytes = 18 * 2 * 1 * 256 * 4  # Gemma 3 270M: 18 layers, 1 KV head of 256, K and V, float32
    if isinstance(workload, ChatAgents):
        tokens = 1500 + workload.agents * workload.turns * (60 + workload.reply_tokens)
    else:
        tokens = 1400 + workload.questions * 30
    return System("hybrid on, half budget", "radixserve", ("--kv-cache-memory", str(tokens * token_bytes // 2)))


def _reuse_verdicts(name: str, records: dict[str, RunRecord]) -> list[str]:
    on, off = records["hybrid on"], records["hybrid off"]
    out = [f"{name}: hybrid on {on.wall_s / off.wall_s:.2f}x hybrid off's wall (target <= 1.2x) "
           f"[{'met' if on.wall_s <= 1.2 * off.wall_s else 'MISSED'}]",
           f"{name}: hybrid on {on.reuse:.1%} of ideal reuse (target >= 95%) [{'met' if on.reuse >= 0.95 else 'MISSED'}]",
           f"{name}: hybrid on holds {on.server['kv_peak_held_bytes'] / max(1, off.server['kv_peak_held_bytes']):.2f}x "
           f"hybrid off's KV bytes (target <= 0.5x)",
           f"{name}: answers equal to hybrid off: {on.answers == off.answers}"]
    int8 = records.get("hybrid on, int8 KV")
    if int8:
        out.append(f"{name}: int8 KV {int8.reuse:.1%} of ideal reuse, {int8.wall_s / off.wall_s:.2f}x hybrid off's wall")
    half = records.get("hybrid on, half budget")
    if half:
        out.append(f"{name}: half budget {half.reuse:.1%} of ideal reuse (target >= 90%) "
                   f"[{'met' if half.reuse >= 0.9 else 'MISSED'}]")
    llama = records.get("llama.cpp")
    if llama:
        out.append(f"{name}: hybrid on {on.wall_s / llama.wall_s:.2f}x llama.cpp's wall (target <= 0.25x) "
                   f"[{'met' if on.wall_s <= 0.25 * llama.wall_s else 'MISSED'}]")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick="3 agents x 3 turns, 8 questions, quiet and one neighbour only")
    parser.add_argument("--parts", default="contention,reuse")
    parser.add_argument("--models", default=f"default,{GEMMA}", help="the contention part's models")
    parser.add_argument("--workloads", default="agents,fewshot")
    parser.add_argument("--busy", default="0,1,2", help="CPU-bound neighbours per contention run")
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--questions", type=int, default=24)
    add_llama_server(parser, "llama.cpp's llama-server binary (or LLAMA_SERVER); left out when not given")
    args = parser.parse_args(argv)
    apply_quick(parser, args, agents=3, turns=3, questions=8, busy="0,1")
    args.busy = [int(b) for b in args.busy.split(",")]
    chosen = args.workloads.split(",")
    workloads = ([ChatAgents(args.agents, args.turns)] if "agents" in chosen else []) + (
        [FewShot(args.questions)] if "fewshot" in chosen else [])
    print(f"agents' real conditions, on {len(os.sched_getaffinity(0))} usable cores; "
          f"llama.cpp: {args.llama_server or 'not given'}")
    figures, verdicts = Figures(), []
    if "contention" in args.parts:
        verdicts += contention(args, workloads, figures)
    if "reuse" in args.parts:
        verdicts += reuse(args, workloads, figures)
    print("\n== verdicts")
    for line in verdicts:
        print("  " + line)
    figures.finish(args, "agents' real conditions: wall s", "s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
