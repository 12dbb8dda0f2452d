"""DSL benchmark workloads: synthetic HellaSwag-style few-shot selects and a tree of thought.

The text is drawn from a seeded generator of simple sentences (no dataset download), so
every system sees exactly the same programs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import radixserve.lang as rl

SUBJECTS = [
    "The chef", "A farmer", "The teacher", "My neighbor", "A young girl", "The old man", "The mechanic",
    "A student", "The nurse", "A tourist", "The painter", "A boy", "The driver", "A woman", "The coach",
]
PLACES = [
    "in the kitchen", "in the garden", "at the station", "in the garage", "at the beach", "in the office",
    "at the park", "in the classroom", "by the river", "at the market",
]
# (what the context says someone does, how it plausibly goes on)
ACTIVITIES = [
    ("fills a bucket with warm water and soap", "then washes the car until it shines"),
    ("opens the oven door", "then takes out a tray of fresh bread"),
    ("ties a pair of running shoes", "then jogs slowly around the block"),
    ("unrolls a long yoga mat", "then stretches both arms toward the sky"),
    ("picks up a paint brush", "then paints the fence a bright shade of blue"),
    ("puts a kettle on the stove", "then pours hot tea into two cups"),
    ("opens a thick book", "then reads the first chapter aloud"),
    ("grabs a pair of scissors", "then cuts the paper into small squares"),
    ("lifts the hood of the truck", "then checks the oil with a thin stick"),
    ("spreads a blanket on the grass", "then sets out sandwiches and apples"),
    ("tunes an old guitar", "then plays a quiet song for the crowd"),
    ("plants a small seed in a pot", "then waters the soil very gently"),
    ("fills a bowl with flour and eggs", "then mixes the dough with a wooden spoon"),
    ("takes a ball out of a bag", "then kicks it hard toward the goal"),
    ("sets a ladder against the wall", "then climbs up to clean the window"),
    ("opens a box of colored pencils", "then draws a house with a red roof"),
]


@dataclass(frozen=True)
class Question:
    context: str
    endings: list[str]
    label: int


def hellaswag_like(num_questions: int, shots: int = 20, seed: int = 0) -> tuple[str, list[Question]]:
    """(few-shot block of `shots` solved items, questions with 4 endings each)."""
    rng = random.Random(seed)
    solved = [_question(rng) for _ in range(shots)]
    block = "".join(f"{q.context} {q.endings[q.label]}.\n" for q in solved)
    return block, [_question(rng) for _ in range(num_questions)]


@rl.function
def choose_ending(s, block, context, endings):
    s += block + context + rl.select("ending", choices=[" " + e for e in endings])


TOT_SYSTEM = (
    "You are a planning assistant. You break every problem into short numbered steps, check each "
    "step against the goal, and keep the plan practical: it must fit the budget, the time and the "
    "people available. Prefer cheap steps that can be tried within a week, and say what to measure."
)
GOALS = ["waste less food", "save water", "get more visitors", "cut energy costs", "finish work on time"]
GROUPS = ["a small bakery", "a school", "a city library", "a football club", "a family farm", "a hotel"]


def tot_problems(num_problems: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [
        f"Plan how {rng.choice(GROUPS)} can {rng.choice(GOALS)} this month with {rng.randint(2, 9)} people "
        f"and {rng.randint(1, 20) * 100} dollars."
        for _ in range(num_problems)
    ]


@rl.function
def tree_of_thought(s, problem, width, depth, keep, step_tokens):
    """Propose `width` steps per node (sampled, fixed length), judge each by a yes/no select
    on a fork, expand the best `keep`, then write an answer after the best path."""
    s += rl.system(TOT_SYSTEM)
    s += rl.user(problem)
    s += rl.assistant_begin()
    frontier = [s]
    for level in range(depth):
        branches = []
        for parent in frontier:
            forks = parent.fork(width)
            for i, branch in enumerate(forks):
                branch += f"Step {level + 1}:" + rl.gen("step", max_tokens=step_tokens, ignore_eos=True, seed=i) + "\n"
            branches += list(forks)
        scores = _judge(branches)
        ranked = sorted(range(len(branches)), key=lambda i: scores[i], reverse=True)
        frontier = [branches[i] for i in ranked[:keep]]
    best = frontier[0]
    best += "Answer:" + rl.gen("answer", max_tokens=step_tokens, ignore_eos=True)
    s += best["answer"]  # the parent waits for the search (and records its answer)


def _judge(branches: list[rl.ProgramState]) -> list[float]:
    probes = []
    for branch in branches:
        (probe,) = branch.fork(1)
        probe += "Is this step useful? Answer:" + rl.select("ok", choices=[" yes", " no"])
        probes.append(probe)
    return [p.scores("ok").total_logprobs[0] - p.scores("ok").total_logprobs[1] for p in probes]


def _question(rng: random.Random) -> Question:
    activity, ending = rng.choice(ACTIVITIES)
    others = rng.sample([e for a, e in ACTIVITIES if e != ending], 3)
    endings = others + [ending]
    rng.shuffle(endings)
    context = f"{rng.choice(SUBJECTS)} {activity} {rng.choice(PLACES)},"
    return Question(context, endings, endings.index(ending))
