"""An SGLang program, unchanged, against radixserve: few-shot routing with `run_batch`.

Written with SGLang's own frontend (`import sglang as sgl`, the `sglang` extra): the only
radixserve-specific line is the URL. Every program starts with the same instruction and
labelled examples; `cache_prefix` computes that block once (a prefill-only request,
`max_new_tokens: 0`), then `select` picks each message's team by the labels' token
log-probabilities and a regex-constrained `gen` adds an urgency. The radix cache serves the
shared block to every program.

    radixserve serve &                                       # or any radixserve server
    python examples/sglang_fewshot.py --url http://127.0.0.1:30000
    python examples/sglang_fewshot.py --url http://127.0.0.1:30000 --limit 3   # smoke test
"""

from __future__ import annotations

import argparse
import sys
import urllib.request

import sglang as sgl

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
]

FEW_SHOT = "Route each customer message to its team: " + ", ".join(LABELS) + ".\n\n" + "".join(
    f"Message: {text}\nTeam: {label}\n\n" for text, label in EXAMPLES
)


@sgl.function
def route(s, message):
    s += FEW_SHOT + f"Message: {message}\nTeam: " + sgl.select("team", choices=LABELS)
    s += "\nUrgency from 1 (low) to 3 (high): " + sgl.gen("urgency", max_tokens=2, regex="[1-3]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="the radixserve server")
    parser.add_argument("--limit", type=int, default=len(MESSAGES), help="route only the first N messages")
    args = parser.parse_args(argv)

    backend = sgl.RuntimeEndpoint(args.url)
    before = _prompt_counters(args.url)
    backend.cache_prefix(FEW_SHOT)
    states = route.run_batch([{"message": m} for m, _ in MESSAGES[: args.limit]], backend=backend,
                             temperature=0, num_threads=8)
    after = _prompt_counters(args.url)
    correct = 0
    for state, (message, gold) in zip(states, MESSAGES):
        team = state["team"]
        correct += team == gold
        print(f"{team:>10} (urgency {state['urgency'] or '?'})  {'ok ' if team == gold else 'X  '}{message}")
    prompt, cached = after[0] - before[0], after[1] - before[1]
    print(f"answer: {correct}/{len(states)} routed to the expected team")
    print(f"cache hit rate: {cached / max(prompt, 1):.1%} (cached prompt tokens / prompt tokens, from /metrics)")
    return 0


def _prompt_counters(url: str) -> tuple[float, float]:
    """(prompt tokens, cached prompt tokens) the server has seen, from its Prometheus /metrics."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if not line.startswith("#") and value:
            values[name] = float(value)
    return values["radixserve_prompt_tokens_total"], values["radixserve_cached_prompt_tokens_total"]


if __name__ == "__main__":
    sys.exit(main())
