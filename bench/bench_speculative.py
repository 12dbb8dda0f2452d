"""Speculative decoding on agent workloads: no speculation, prompt lookup and suffix drafting
(the request's own tokens and the radix tree's stored sequences) on the same requests.

    .venv/bin/python -m bench.bench_speculative --workload agents   # agent traces, batch 1 and 16, all three
    .venv/bin/python -m bench.bench_speculative --workload agents --batches 16 --repeats 3   # batch 16, less noise
    .venv/bin/python -m bench.bench_speculative                # 10 edit tasks, batch 1 and 8, off and on
    .venv/bin/python -m bench.bench_speculative --repeats 3    # the speedup's spread over three runs
    .venv/bin/python -m bench.bench_speculative --quick        # 5 tasks, batch 1 only
    .venv/bin/python -m bench.bench_speculative --workload records   # one-line records, buggy functions

Workloads (chat template, greedy):
- agents: the agent traces of bench/lib/agent_traces.py, each in turn (tool loops with JSON
  arguments, a coding agent writing an edited copy of a file it read, a ReAct loop, plain chat
  as the control), every request in the order agents send it; each engine keeps its own cache,
  so suffix drafting reads what earlier requests of the same trace said (every engine's cache is
  flushed before each trace, batch and run: a batch never drafts another run's replies of the
  same prompts; --repeats N runs each N times, which engine goes first alternating, and sums
  them, to shrink the machine's noise). Prints, per trace and
  batch, decode tokens/s of each method, the mean accepted length (tokens a verification
  appends), the ratios against no speculation and prompt lookup, and the issue's targets.
- edits (default): an agent's file edits, the file shown as a tool would show it (fenced,
  formatted the way the model writes it) and the whole file asked back with one change: a
  JSON record with a field changed, a function renamed or fixed, a YAML value changed, a
  paragraph's typo fixed, a CSV cell changed.
- records: "return this JSON record with one field changed" (the record on one line, which
  the model re-formats) and "repeat this function with the bug fixed" (which it often
  rewrites): less is copied.
One engine per configuration, both in this process; every configuration gets an untimed
warm-up. For batch 1 every task runs alone; for batch 8 eight at once; each group runs on both
engines in turn, which goes first alternating, so the machine's drift falls on both. Reports
decode tokens/s (output tokens after the first, over the time after the first token), the
speedup, the acceptance rate, and whether greedy outputs are equal token for token.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass, field

from bench.lib.agent_traces import TRACES, trace
from bench.lib.cli import Figures, apply_quick, bench_parser
from radixserve import Engine, SamplingParams

NAMES = ["Ada", "Grace", "Linus", "Barbara", "Ken", "Margaret", "Dennis", "Frances"]
CITIES = ["Lisbon", "Oslo", "Kyoto", "Quito", "Perth", "Tunis", "Dublin", "Austin"]

FUNCTIONS = [
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(value)\n",
    "def clamp(x, low, high):\n    if x < low:\n        return low\n    if x > high:\n        return low\n    return x\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        counts[word] = counts.get(word, 0) + 1\n    return count\n",
    "def last(items):\n    if not items:\n        return None\n    return items[len(items)]\n",
]


YAML = ("server:\n  host: 0.0.0.0\n  port: {port}\n  workers: 4\ndatabase:\n  url: postgres://db:5432/{name}\n"
        "  pool_size: 10\n  timeout: 30\nlogging:\n  level: info\n  format: json\n")
PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog. It was a sunny day in the valey and the birds were "
    "singing in the tall trees near the river.",
    "Our team shipped the new release on Friday. The update improves startup time, fixes the crash on "
    "empty files, and adds a dark theme that many users had asked for in the last survey. Please report any "
    "problms you find.",
]
EDIT_FUNCTIONS = [
    ("def area(width, height):\n    if width < 0 or height < 0:\n        raise ValueError(\"negative size\")\n"
     "    return width * height\n", "Rename the function to rectangle_area"),
    ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(value)\n",
     "Fix the bug (the last line uses the wrong name)"),
]


def edit_tasks(n: int, seed: int = 0) -> list[list[dict]]:
    """File edits whose answer repeats the file with one change."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            record = {"id": 1000 + i, "name": rng.choice(NAMES), "city": rng.choice(CITIES), "age": rng.randint(20, 70),
                      "status": "open", "tags": rng.sample(["admin", "beta", "vip", "new", "legacy"], 2)}
            text = (f"Here is a JSON record:\n```json\n{json.dumps(record, indent=2)}\n```\n"
                    f"Return the same JSON record with \"status\" changed to \"closed\".")
        elif kind == 1:
            code, change = EDIT_FUNCTIONS[(i // 5) % len(EDIT_FUNCTIONS)]
            text = f"Here is a function:\n```python\n{code}```\n{change} and return the whole function."
        elif kind == 2:
            config = YAML.format(port=8000 + i, name=rng.choice(NAMES).lower())
            text = f"Here is a config file:\n```yaml\n{config}```\nChange the workers to 8 and return the whole file."
        elif kind == 3:
            text = f"Fix the spelling mistake and return the whole paragraph:\n{PARAGRAPHS[(i // 5) % len(PARAGRAPHS)]}"
        else:
            rows = [f"{rng.choice(NAMES)},{rng.choice(CITIES)},{rng.randint(20, 70)}" for _ in range(6)]
            table = "name,city,age\n" + "\n".join(rows)
            text = f"Here is a CSV table:\n```\n{table}\n```\nChange the age in the first row to 99 and return the whole table."
        out.append([{"role": "user", "content": text}])
    return out


def tasks(n: int, seed: int = 0) -> list[list[dict]]:
    """JSON records on one line and buggy functions, to be returned changed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            record = {"id": 1000 + i, "name": rng.choice(NAMES), "city": rng.choice(CITIES), "age": rng.randint(20, 70),
                      "status": "open", "tags": rng.sample(["admin", "beta", "vip", "new", "legacy"], 2)}
            text = (f"Here is a JSON record:\n{json.dumps(record)}\nReturn exactly the same JSON record, with "
                    f"\"status\" changed to \"closed\". Output only the JSON.")
        else:
            text = (f"This Python function has a bug:\n```python\n{FUNCTIONS[(i // 2) % len(FUNCTIONS)]}```\n"
                    f"Repeat the whole function with the bug fixed. Output only the code.")
        out.append([{"role": "user", "content": text}])
    return out


@dataclass
class Tally:
    outputs: list = field(default_factory=list)
    decode_tokens: int = 0
    decode_time: float = 0.0
    wall: float = 0.0

    @property
    def rate(self) -> float:
        return self.decode_tokens / max(1e-9, self.decode_time)


def run(engines: dict[str, Engine], prompts: list[list[int]], params: SamplingParams, batch: int,
        tallies: dict[str, Tally] | None = None, flip: bool = False) -> dict[str, Tally]:
    """Every group of `batch` prompts on each engine in turn (which goes first alternates, and
    `flip` starts the other way), so that the machine's drift falls on all alike; adds to
    `tallies` when given."""
    tallies = tallies if tallies is not None else {name: Tally() for name in engines}
    for g, i in enumerate(range(0, len(prompts), batch)):
        order = list(engines) if (g + flip) % 2 == 0 else list(reversed(engines))
        for name in order:
            t0 = time.perf_counter()
            outs = engines[name].generate(prompts[i:i + batch], params)
            wall = time.perf_counter() - t0
            tally = tallies[name]
            tally.decode_tokens += sum(len(o.token_ids) - 1 for o in outs)
            tally.decode_time += max(1e-9, wall - max(o.metrics["ttft_s"] for o in outs))
            tally.wall += wall
            tally.outputs += outs
    return tallies


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.workload == "agents":
        return agents(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    common = dict(max_num_seqs=16, num_threads=args.num_threads)
    spec = dict(speculative="prompt-lookup", speculative_max_batch=max(args.batches))
    if args.k is not None:
        spec["num_speculative_tokens"] = args.k
    if args.ngram_min is not None:
        spec["prompt_lookup_min"] = args.ngram_min
    engines = {"off": Engine(args.model, **common), "prompt-lookup": Engine(args.model, **common, **spec)}
    k = engines["prompt-lookup"].config.num_speculative_tokens
    prompts = [engines["off"].apply_chat_template(m) for m in WORKLOADS[args.workload](args.tasks)]
    for engine in engines.values():  # untimed warm-up
        engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))
    print(f"speculative decoding (prompt lookup, up to k={k} tokens) on {args.tasks} copy-the-context agent "
          f"tasks ({args.workload}: {WORKLOAD_NOTES[args.workload]}), greedy, max_tokens {args.max_tokens}, "
          f"model {engines['off'].model_name}")
    results, figures = {}, Figures()
    for batch in args.batches:
        speedups, spec = [], engines["prompt-lookup"]
        for repeat in range(args.repeats):
            before = spec.stats()
            tallies = run(engines, prompts, params, batch)
            after = spec.stats()
            for engine in engines.values():
                engine.check_integrity()
            off, on = tallies["off"], tallies["prompt-lookup"]
            drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            steps = after["steps"] - before["steps"]
            speedups.append(on.rate / off.rate)
            figures.add(f"batch {batch}, run {repeat + 1}", "off", off.rate, wall_s=off.wall)
            figures.add(f"batch {batch}, run {repeat + 1}", "prompt-lookup", on.rate, wall_s=on.wall,
                        accepted=accepted, drafted=drafted, steps=steps)
            results[batch] = on
            equal = sum(a.token_ids == b.token_ids for a, b in zip(off.outputs, on.outputs))
            tokens = sum(len(o.token_ids) for o in off.outputs)
            print(f"\n== batch {batch}, run {repeat + 1}/{args.repeats}: {tokens} output tokens")
            print(f"   off:           {off.rate:7.1f} decode tok/s, {off.wall:6.1f} s")
            print(f"   prompt-lookup: {on.rate:7.1f} decode tok/s, {on.wall:6.1f} s, {steps} steps; "
                  f"acceptance {accepted}/{drafted} = {accepted / max(1, drafted):.1%}")
            print(f"   speedup {on.rate / off.rate:.2f}x decode tok/s ({off.wall / on.wall:.2f}x wall)")
            print(f"   greedy outputs equal token for token: {equal}/{len(prompts)}")
        speedups.sort()
        print(f"-- batch {batch}: speedup median {speedups[len(speedups) // 2]:.2f}x [{speedups[0]:.2f}-{speedups[-1]:.2f}] "
              f"over {args.repeats} run(s)" + ("  (target >= 1.8x at batch 1)" if batch == 1 else ""))
    figures.finish(args, "decode tokens/s, prompt lookup off / on", "decode tokens / s")
    if args.show:
        for o in results[args.batches[0]].outputs[:2]:
            print("\n---\n" + o.text)
    return 0


def agents(args) -> int:
    """Every agent trace on no speculation, prompt lookup and suffix drafting, batch by batch."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    common = dict(max_num_seqs=16, num_threads=args.num_threads)  # speculative_max_batch: the engine's
    if args.max_batch is not None:
        common["speculative_max_batch"] = args.max_batch
    if args.k is not None:
        common["num_speculative_tokens"] = args.k
    engines = {"off": Engine(args.model, max_num_seqs=16, num_threads=args.num_threads),
               "prompt-lookup": Engine(args.model, speculative="prompt-lookup", **common),
               "suffix": Engine(args.model, speculative="suffix", speculative_tree_width=args.tree_width, **common)}
    for engine in engines.values():  # untimed warm-up
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    k = engines["suffix"].config.num_speculative_tokens
    print(f"speculative decoding on agent traces: off / prompt-lookup / suffix (up to k={k}, draft length "
          f"adaptive, draft trees of width {args.tree_width}), greedy, max_tokens {args.max_tokens}, model {engines['off'].model_name}, batches {args.batches}")
    figures, summary = Figures(), {}
    for name in args.traces:
        workload = trace(name)
        print(f"\n### {workload.describe()}")
        prompts = [engines["off"].apply_chat_template(m) for m in workload.requests]
        for batch in args.batches:
            before = {n: e.stats() for n, e in engines.items()}
            tallies = None
            for repeat in range(args.repeats):
                for engine in engines.values():  # each run drafts from its own trace's earlier requests only
                    engine.flush_cache()
                tallies = run(engines, prompts, params, batch, tallies, flip=repeat % 2 == 1)
                for engine in engines.values():
                    engine.check_integrity()
            off = tallies["off"]
            print(f"== {name}, batch {batch}: {sum(len(o.token_ids) for o in off.outputs)} output tokens"
                  + (f" ({args.repeats} runs, each from an empty cache)" if args.repeats > 1 else ""))
            for method, tally in tallies.items():
                after = engines[method].stats()
                delta = {key: after[key] - before[method][key] for key in
                         ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_tree_drafts", "steps")}
                length = (delta["spec_accepted_tokens"] + delta["spec_drafts"]) / max(1, delta["spec_drafts"])
                equal = sum(a.token_ids == b.token_ids for a, b in zip(off.outputs, tally.outputs))
                summary[(name, batch, method)] = (tally.rate, length)
                figures.add(f"{name}, batch {batch}", method, tally.rate, steps=delta["steps"], accepted_length=length,
                            drafts=delta["spec_drafts"], tree_drafts=delta["spec_tree_drafts"], equal=equal)
                print(f"   {method:14s} {tally.rate:7.1f} decode tok/s ({tally.rate / off.rate:.2f}x off), "
                      f"{delta['steps']} steps, {delta['spec_drafts']} drafts ({delta['spec_tree_drafts']} from the "
                      f"tree), accepted length {length:.2f}, "
                      f"acceptance {delta['spec_accepted_tokens']}/{delta['spec_draft_tokens']}; "
                      f"greedy equal to off {equal}/{len(off.outputs)}")
            pl, sx = summary[(name, batch, "prompt-lookup")][0], summary[(name, batch, "suffix")][0]
            print(f"   suffix: {sx / off.rate:.2f}x off, {sx / pl:.2f}x prompt lookup")
    _targets(summary, args)
    figures.finish(args, "decode tokens/s: off, prompt lookup, suffix drafting", "decode tokens / s")
    return 0


def _targets(summary: dict, args) -> None:
    """The issue's targets, from this run's figures."""
    print("\n== targets (issue 61)")
    agent = [t for t in args.traces if t != "chat"]
    if 1 in args.batches and agent:
        lengths = [summary[(t, 1, "suffix")][1] for t in agent]
        vs_pl = [summary[(t, 1, "suffix")][0] / summary[(t, 1, "prompt-lookup")][0] for t in agent]
        vs_off = [summary[(t, 1, "suffix")][0] / summary[(t, 1, "off")][0] for t in agent]
        for label, values, target in (("mean accepted length", lengths, 3.0), ("decode tok/s vs prompt lookup", vs_pl, 1.5),
                                      ("decode tok/s vs no speculation", vs_off, 2.5)):
            mean = sum(values) / len(values)
            print(f"   batch 1, agent traces, {label}: " + ", ".join(f"{t} {v:.2f}" for t, v in zip(agent, values))
                  + f"; mean {mean:.2f} (target >= {target}: {'met' if mean >= target else 'not met'})")
    if 1 in args.batches and "chat" in args.traces:
        ratio = summary[("chat", 1, "suffix")][0] / summary[("chat", 1, "off")][0]
        print(f"   batch 1, plain chat, suffix vs no speculation: {ratio:.2f}x (target >= 1.0: "
              f"{'met' if ratio >= 1.0 else 'not met'})")
    for batch in (b for b in args.batches if b > 1):
        ratios = [summary[(t, batch, "suffix")][0] / summary[(t, batch, "off")][0] for t in args.traces]
        print(f"   batch {batch}, suffix vs no speculation: " + ", ".join(f"{t} {r:.2f}" for t, r in zip(args.traces, ratios))
              + f"; lowest {min(ratios):.2f} (target >= 0.98: {'met' if min(ratios) >= 0.98 else 'not met'})")


WORKLOADS = {"edits": edit_tasks, "records": tasks}
WORKLOAD_NOTES = {"edits": "files shown fenced and asked back with one change",
                  "records": "one-line JSON record / buggy function asked back changed"}


def _parse_args(argv):
    p = bench_parser(__doc__, quick="5 tasks, batch 1 only")
    p.add_argument("--model", default=None)
    p.add_argument("--workload", choices=sorted(WORKLOADS) + ["agents"], default="edits")
    p.add_argument("--traces", nargs="+", choices=list(TRACES), default=list(TRACES),
                   help="with --workload agents: which agent traces")
    p.add_argument("--tasks", type=int, default=10)
    p.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 8 (agents: 1 16)")
    p.add_argument("--max-tokens", type=int, default=None, help="default: 128 (agents: 96)")
    p.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: the engine's)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="with --workload agents: speculative_max_batch (default: the engine's)")
    p.add_argument("--ngram-min", type=int, default=None, help="prompt_lookup_min (default: the engine's)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each batch size (the speedup's spread)")
    p.add_argument("--tree-width", type=int, default=1,
                   help="agents: suffix drafting's speculative_tree_width (1: chains; 2+: draft trees)")
    p.add_argument("--show", action="store_true", help="print two outputs")
    args = p.parse_args(argv)
    apply_quick(p, args, tasks=5, batches=[1])
    if args.batches is None:
        args.batches = [1, 16] if args.workload == "agents" else [1, 8]
    if args.max_tokens is None:
        args.max_tokens = 96 if args.workload == "agents" else 128
    return args


if __name__ == "__main__":
    sys.exit(main())
