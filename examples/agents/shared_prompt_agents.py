"""Several agents sharing one long system prompt, taking turns.

A planner, an engineer and a critic discuss a launch. Every agent's turn is one program:
the same long system prompt (the team handbook), then the transcript so far, then that
agent's own instruction. The handbook and the growing transcript are a common prefix of
every turn, so each turn computes little more than the newest line and the instruction.
A regex keeps each contribution to one sentence that starts with a capital letter.

    python examples/agents/shared_prompt_agents.py                 # in process
    python examples/agents/shared_prompt_agents.py --url http://127.0.0.1:30000
    python examples/agents/shared_prompt_agents.py --rounds 1 --max-tokens 4   # smoke test
"""

from __future__ import annotations

import argparse
import sys

import radixserve.lang as rl

HANDBOOK = """You are part of the product team of Lumen, a company that makes a bicycle light.
Facts about the product:
- The Lumen light gives 400 lumens and runs 6 hours on one charge.
- It charges over USB-C in 2 hours and weighs 90 grams.
- It costs 35 dollars to build and sells for 79 dollars.
- The first batch has 2000 units and ships in four weeks.
- Retail partners: two bike shops in Berlin and one online store.
Team rules:
- Speak in one short sentence per turn.
- Build on what the others said; do not repeat them.
- Stay concrete: numbers, dates, names.
- The meeting decides how to launch the first batch."""

AGENTS = {
    "Planner": "You plan the launch: dates, channels and order of tasks.",
    "Engineer": "You care about the product: battery, charging, quality and shipping risks.",
    "Critic": "You point out the weakest part of the plan and suggest a fix.",
}

ONE_SENTENCE = r" [A-Z][^\n.!?:]{8,160}[.!?]"


@rl.function
def take_turn(s, name, transcript):
    s += rl.system(HANDBOOK)
    s += rl.user(f"The meeting so far:\n{transcript}\n\nYou are the {name}. {AGENTS[name]} Say your next sentence.")
    s += rl.assistant(f"{name}:" + rl.gen("line", regex=ONE_SENTENCE))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a radixserve server; default: in process")
    parser.add_argument("--model", default=None, help="model for the in-process runtime")
    parser.add_argument("--rounds", type=int, default=3, help="turns of every agent")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per turn")
    args = parser.parse_args(argv)

    backend = rl.Endpoint(args.url) if args.url else rl.Runtime(args.model)
    transcript = ["Chair: Let us plan the launch of the first batch."]
    try:
        before = backend.stats()
        for _ in range(args.rounds):
            for name in AGENTS:
                state = take_turn.run(  # sampled, seeded per turn: greedy decoding repeats itself
                    name=name, transcript="\n".join(transcript), backend=backend,
                    temperature=0.7, seed=len(transcript), max_tokens=args.max_tokens,
                )
                transcript.append(f"{name}: {state['line'].strip()}")
                print(transcript[-1])
        rate = rl.hit_rate(backend.stats(), before)
    finally:
        backend.shutdown()
    print(f"answer: {len(transcript) - 1} turns; last word to {transcript[-1].split(':')[0]}")
    print(f"cache hit rate: {rate:.1%} (cached prompt tokens / prompt tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
