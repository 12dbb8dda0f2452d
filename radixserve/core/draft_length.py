"""How many tokens a draft should have, from what verifying costs here and what the request
accepts: the length that maximises tokens per second, 0 (no draft) where none pays.

A step's time depends on its rows (every decoding request's token plus every draft token):
on a CPU whose kernels are compute-bound at a few rows (this project's AVX2 machine: 4 rows
2.2x one row's time, 8 rows 6x) long drafts cost more than they save; where rows are nearly
free (AVX512-VNNI, GPUs) they pay. StepCosts keeps the measured time of decode-only steps
per row count (a running average); a count never seen is estimated from its neighbours, or
past the largest seen along the slope of the last two (optimistically where only one was seen,
so that a length gets tried once and then judged).

With per-token acceptance p (each draft token accepted with probability p given the ones
before were), a draft of k tokens appends 1 + p + ... + p^k tokens on average; with d
requests decoding, the step's throughput is (d - 1 + that) / time(d + k) against
d / time(d) without the draft.
"""

from __future__ import annotations

EMA = 0.2  # weight of the newest step time of a row count
OPTIMISTIC_ROW = 0.15  # past the largest row count seen, each row is guessed at this share of one row's step
MARGIN = 1.03  # a draft must promise this much more throughput than none (noise in the step times)
# A row count above the one just measured, not measured itself for this many decode steps, is
# forgotten (estimated afresh from its neighbours, so tried again): a count measured once while
# other jobs slowed the machine would otherwise look dear for good, since only the counts that
# drafts use are ever measured again. Smaller counts (the batch without drafts) are kept.
STALE_STEPS = 256


class StepCosts:
    """Measured decode step time (ms) by its number of rows."""

    def __init__(self) -> None:
        self.ms: dict[int, float] = {}
        self.last_seen: dict[int, int] = {}  # rows -> the step count when last measured
        self.steps = 0

    def observe(self, rows: int, ms: float) -> None:
        self.steps += 1
        old = self.ms.get(rows)
        self.ms[rows] = ms if old is None else (1 - EMA) * old + EMA * ms
        self.last_seen[rows] = self.steps
        for stale in [r for r, step in self.last_seen.items() if r > rows and self.steps - step > STALE_STEPS]:
            del self.ms[stale], self.last_seen[stale]

    def estimate(self, rows: int) -> float | None:
        """The step time of `rows` rows, or None before any decode step was measured."""
        if rows in self.ms:
            return self.ms[rows]
        if not self.ms:
            return None
        below = max((r for r in self.ms if r < rows), default=None)
        above = min((r for r in self.ms if r > rows), default=None)
        if below is not None and above is not None:
            share = (rows - below) / (above - below)
            return self.ms[below] + share * (self.ms[above] - self.ms[below])
        if above is not None:  # fewer rows than any seen: no cheaper than proportional
            return self.ms[above] * rows / above
        return self.ms[below] + (rows - below) * self._slope(below)

    def _slope(self, top: int) -> float:
        """ms per row past `top`, the largest count seen: the slope from the count seen before it,
        else an optimistic guess (tried once, then measured)."""
        before = max((r for r in self.ms if r < top), default=None)
        if before is None:
            return OPTIMISTIC_ROW * self.ms[top] / top
        return max(0.0, (self.ms[top] - self.ms[before]) / (top - before))


def best_length(p: float, decodes: int, most: int, costs: StepCosts) -> int:
    """The draft length in [0, most] with the highest expected throughput for a request whose
    draft tokens are accepted with probability p, beside decodes - 1 other decoding requests
    that draft nothing; `most` where nothing was measured yet."""
    return draft_lengths([p], [most], decodes, costs)[0]


def draft_lengths(ps: list[float], caps: list[int], decodes: int, costs: StepCosts,
                  fixed_rows: int = 0, budget: int | None = None) -> list[int]:
    """Draft lengths for one step's drafting requests together (acceptance ps[i], at most
    caps[i] tokens each), beside `decodes` decoding requests in all and `fixed_rows` rows
    drafted anyway (forced text, counted as accepted): the split with the highest expected
    tokens per second, all zero where none beats drafting nothing by MARGIN.

    Every row of the step is paid by the whole batch, so the lengths are chosen together:
    the j-th draft token of request i adds ps[i] ** j tokens on average; the best n tokens
    of the step are the n largest of those (a request's j-th token is never chosen before
    its (j-1)-th), and n runs over every total up to `budget`. The caps where nothing was
    measured yet (a first step is tried, then judged)."""
    base = costs.estimate(decodes + fixed_rows)
    if base is None:
        return _within(list(caps), budget)
    gains = sorted(((p ** j, i) for i, (p, cap) in enumerate(zip(ps, caps)) for j in range(1, cap + 1)),
                   key=lambda g: -g[0])
    if budget is not None:
        gains = gains[:max(0, budget)]
    tokens = float(decodes + fixed_rows)
    best_n, best = 0, MARGIN * tokens / base
    for n, (gain, _) in enumerate(gains, 1):
        tokens += gain
        rate = tokens / costs.estimate(decodes + fixed_rows + n)
        if rate > best:
            best_n, best = n, rate
    lengths = [0] * len(ps)
    for _, i in gains[:best_n]:
        lengths[i] += 1
    return lengths


def _within(lengths: list[int], budget: int | None) -> list[int]:
    """The lengths cut, in order, to a total of at most budget."""
    if budget is None:
        return lengths
    out = []
    for length in lengths:
        out.append(min(length, max(0, budget)))
        budget -= out[-1]
    return out
