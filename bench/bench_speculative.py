"""Prompt-lookup speculative decoding on an agent workload whose outputs copy their context.

    .venv/bin/python -m bench.bench_speculative            # 8 tasks, batch 1 and 8, speculation off and on
    .venv/bin/python -m bench.bench_speculative --quick    # 4 tasks, batch 1 only

Tasks (chat template, greedy): "return this JSON record with one field changed" and "repeat
this function with the bug fixed", each with its record or function in the prompt. One engine
per configuration, both in this process; every configuration gets an untimed warm-up. For batch 1
every task runs alone; for batch 8 all run at once. Reports decode tokens/s (output tokens after
the first, over the time after the first token), the speedup, the acceptance rate, and whether
greedy outputs are equal token for token.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from radixserve import Engine, SamplingParams

NAMES = ["Ada", "Grace", "Linus", "Barbara", "Ken", "Margaret", "Dennis", "Frances"]
CITIES = ["Lisbon", "Oslo", "Kyoto", "Quito", "Perth", "Tunis", "Dublin", "Austin"]

FUNCTIONS = [
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(value)\n",
    "def clamp(x, low, high):\n    if x < low:\n        return low\n    if x > high:\n        return low\n    return x\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        counts[word] = counts.get(word, 0) + 1\n    return count\n",
    "def last(items):\n    if not items:\n        return None\n    return items[len(items)]\n",
]


def tasks(n: int, seed: int = 0) -> list[list[dict]]:
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


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams, batch: int):
    """Returns (outputs, decode tokens/s, wall seconds)."""
    outputs, decode_tokens, decode_time = [], 0, 0.0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        t0 = time.perf_counter()
        outs = engine.generate(prompts[i:i + batch], params)
        wall = time.perf_counter() - t0
        first = max(o.metrics["ttft_s"] for o in outs)
        decode_tokens += sum(len(o.token_ids) - 1 for o in outs)
        decode_time += max(1e-9, wall - first)
        outputs += outs
    return outputs, decode_tokens / decode_time, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    common = dict(max_num_seqs=16, num_threads=args.num_threads)
    engines = {
        "off": Engine(args.model, **common),
        "prompt-lookup": Engine(args.model, **common, speculative="prompt-lookup",
                                num_speculative_tokens=args.k, speculative_max_batch=max(args.batches),
                                prompt_lookup_min=args.ngram_min),
    }
    prompts = [engines["off"].apply_chat_template(m) for m in tasks(args.tasks)]
    for engine in engines.values():  # untimed warm-up
        engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))
    print(f"speculative decoding (prompt lookup, k={args.k}) on {args.tasks} copy-the-context agent tasks "
          f"(JSON record with a field changed / function with a fix), greedy, max_tokens {args.max_tokens}, "
          f"model {engines['off'].model_name}")
    results = {}
    for batch in args.batches:
        for name, engine in engines.items():
            before = engine.stats()
            outs, rate, wall = run(engine, prompts, params, batch)
            after = engine.stats()
            drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            results[(batch, name)] = (outs, rate, wall, drafted, accepted, after["steps"] - before["steps"])
            engine.check_integrity()
        off, on = results[(batch, "off")], results[(batch, "prompt-lookup")]
        equal = sum(a.token_ids == b.token_ids for a, b in zip(off[0], on[0]))
        tokens = sum(len(o.token_ids) for o in off[0])
        print(f"\n== batch {batch}: {tokens} output tokens")
        print(f"   off:           {off[1]:7.1f} decode tok/s, {off[2]:6.1f} s, {off[5]} steps")
        print(f"   prompt-lookup: {on[1]:7.1f} decode tok/s, {on[2]:6.1f} s, {on[5]} steps; "
              f"acceptance {on[4]}/{on[3]} = {on[4] / max(1, on[3]):.1%}")
        print(f"   speedup {on[1] / off[1]:.2f}x decode tok/s ({off[2] / on[2]:.2f}x wall)"
              + ("  (target >= 1.8x at batch 1)" if batch == 1 else ""))
        print(f"   greedy outputs equal token for token: {equal}/{len(prompts)}")
    if args.show:
        for o in results[(args.batches[0], "prompt-lookup")][0][:2]:
            print("\n---\n" + o.text)
    return 0


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--ngram-min", type=int, default=2, help="prompt_lookup_min")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="4 tasks, batch 1 only")
    p.add_argument("--show", action="store_true", help="print two outputs")
    args = p.parse_args(argv)
    if args.quick:
        args.tasks, args.batches = 4, [1]
    return args


if __name__ == "__main__":
    sys.exit(main())
