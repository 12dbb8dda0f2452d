"""A few-shot classification pipeline with `run_batch`.

Every program starts with the same instruction and labelled examples (plain text: the
135M model follows this format better than chat turns), then one customer message;
`select` picks the label by the labels' token log-probabilities, and a short
regex-constrained gen adds an urgency. All programs run concurrently, so the shared
few-shot block is computed once and read from the prefix cache by every other program.

    python examples/agents/fewshot_classify.py                 # in process
    python examples/agents/fewshot_classify.py --url http://127.0.0.1:30000
    python examples/agents/fewshot_classify.py --limit 3 --max-tokens 2   # smoke test
"""

from __future__ import annotations

import argparse
import sys

import radixserve.lang as rl

LABELS = ["billing", "technical", "shipping", "account"]

EXAMPLES = [  # labels interleaved: a small model copies runs of the same label
    ("The courier delivered my parcel to the wrong address.", "shipping"),
    ("I cannot log in because I forgot my password.", "account"),
    ("I was charged twice for the same order.", "billing"),
    ("The website shows an error when I upload a photo.", "technical"),
    ("Please change the email address on my profile.", "account"),
    ("My package has been stuck in transit for a week.", "shipping"),
    ("The app crashes every time I open the settings page.", "technical"),
    ("Why is there an extra fee on my invoice?", "billing"),
]

MESSAGES = [
    ("My credit card was billed for a subscription I cancelled.", "billing"),
    ("The tracking number you sent me does not work.", "shipping"),
    ("After the update the program freezes on startup.", "technical"),
    ("How do I delete my account and all my data?", "account"),
    ("I got a refund for the wrong amount.", "billing"),
    ("The box arrived damaged and two items are missing.", "shipping"),
    ("The login page keeps saying my username is taken.", "account"),
    ("The printer driver will not install on my laptop.", "technical"),
]

FEW_SHOT = "Route each customer message to its team: " + ", ".join(LABELS) + ".\n\n" + "".join(
    f"Message: {text}\nTeam: {label}\n\n" for text, label in EXAMPLES
)


@rl.function
def classify(s, message):
    s += FEW_SHOT + f"Message: {message}\nTeam: " + rl.select("team", choices=LABELS)
    s += "\nUrgency from 1 (low) to 3 (high): " + rl.gen("urgency", regex="[1-3]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a radixserve server; default: in process")
    parser.add_argument("--model", default=None, help="model for the in-process runtime")
    parser.add_argument("--limit", type=int, default=len(MESSAGES), help="classify only the first N messages")
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens for the urgency gen")
    args = parser.parse_args(argv)

    backend = rl.Endpoint(args.url) if args.url else rl.Runtime(args.model)
    try:
        before = backend.stats()
        batch = [{"message": m} for m, _ in MESSAGES[: args.limit]]
        states = classify.run_batch(batch, backend=backend, temperature=0, max_tokens=args.max_tokens, progress_bar=True)
        rate = rl.hit_rate(backend.stats(), before)
    finally:
        backend.shutdown()
    correct = 0
    for state, (message, gold) in zip(states, MESSAGES):
        team = state["team"]
        correct += team == gold
        print(f"{team:>10} (urgency {state['urgency'] or '?'})  {'ok ' if team == gold else 'X  '}{message}")
    print(f"answer: {correct}/{len(states)} routed to the expected team")
    print(f"cache hit rate: {rate:.1%} (cached prompt tokens / prompt tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
