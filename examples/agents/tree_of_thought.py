"""A tree-of-thought search with `fork`.

From the problem, `fork` proposes several first steps (sampled with different seeds), a
`select` between "yes" and "no" judges each one (its score is log p(yes) - log p(no)),
the best few are expanded the same way one level deeper, and the best path gets a final
answer. Every branch continues its parent's text, so all of them read the problem and the
path so far from the prefix cache instead of computing it again.

    python examples/agents/tree_of_thought.py                    # in process
    python examples/agents/tree_of_thought.py --url http://127.0.0.1:30000
    python examples/agents/tree_of_thought.py --max-tokens 4 --width 2 --depth 1   # smoke test
"""

from __future__ import annotations

import argparse
import sys

import radixserve.lang as rl

PROBLEM = (
    "A small bakery sells 40 loaves of bread a day but throws away 10 of them every evening. "
    "Suggest a plan, step by step, to waste less bread without selling less."
)
SENTENCE = r" [A-Z][^\n]{4,}"  # a small model may otherwise end a step before it starts


@rl.function
def tree_of_thought(s, problem, width, depth, keep, step_tokens):
    s += rl.system("You solve problems one short step at a time.")
    s += rl.user(problem)
    s += rl.assistant_begin()
    frontier = [s]
    for level in range(depth):
        branches = [b for parent in frontier for b in _propose(parent, width, level, step_tokens)]
        scores = _judge(branches)
        ranked = sorted(range(len(branches)), key=lambda i: scores[i], reverse=True)
        frontier = [branches[i] for i in ranked[:keep]]
    best = frontier[0]
    best += "Answer:" + rl.gen("answer", max_tokens=2 * step_tokens, regex=SENTENCE)
    best += rl.assistant_end()
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a radixserve server; default: in process")
    parser.add_argument("--model", default=None, help="model for the in-process runtime")
    parser.add_argument("--problem", default=PROBLEM)
    parser.add_argument("--width", type=int, default=3, help="thoughts proposed per node")
    parser.add_argument("--depth", type=int, default=2, help="levels of thoughts")
    parser.add_argument("--keep", type=int, default=2, help="best nodes expanded at each level")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per thought")
    args = parser.parse_args(argv)

    backend = rl.Endpoint(args.url) if args.url else rl.Runtime(args.model)
    try:
        before = backend.stats()
        state = tree_of_thought.run(
            args.problem, args.width, args.depth, args.keep, args.max_tokens, backend=backend, temperature=0.8
        )
        best = state.ret_value  # the program returns the state at the end of the best path
        best.sync()
        rate = rl.hit_rate(backend.stats(), before)
    finally:
        backend.shutdown()
    print(f"best path:\n{best.messages()[-1]['content'].strip()}")
    print(f"answer: {best['answer'].strip()}")
    print(f"cache hit rate: {rate:.1%} (cached prompt tokens / prompt tokens)")
    return 0


def _propose(parent: rl.ProgramState, width: int, level: int, step_tokens: int) -> list[rl.ProgramState]:
    """`width` branches of `parent`, each with one more sampled step (generating concurrently)."""
    branches = parent.fork(width)
    for i, branch in enumerate(branches):
        branch += f"Step {level + 1}:" + rl.gen("step", max_tokens=step_tokens, regex=SENTENCE, seed=1000 * level + i)
        branch += "\n"
    return list(branches)


def _judge(branches: list[rl.ProgramState]) -> list[float]:
    """Per branch, log p(yes) - log p(no) of a yes/no question asked on a fork of it (all
    questions queued before any score is read, so they run concurrently)."""
    probes = []
    for branch in branches:
        (probe,) = branch.fork(1)
        probe += "Is this step useful and correct? Answer: " + rl.select("verdict", choices=["yes", "no"])
        probes.append(probe)
    return [_margin(probe.scores("verdict").total_logprobs) for probe in probes]


def _margin(logprobs: list[float]) -> float:
    yes, no = logprobs
    return yes - no


if __name__ == "__main__":
    sys.exit(main())
