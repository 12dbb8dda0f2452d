"""StepCostModel: step time as a + b * decodes + c * prefill_tokens, fitted online from
measured steps, and the prefill token budget that keeps a step under a target (plain Python;
the engine measures, this only does the arithmetic)."""

from __future__ import annotations

# A weak prior (a 2-core CPU running SmolLM2-135M: ~50 ms a step, ~3 ms per extra decode,
# ~1.6 ms per prefill token) so that the first steps get a sensible budget; PRIOR_WEIGHT
# measured steps' worth of evidence, so a few real steps on any machine outweigh it.
PRIOR = (50.0, 3.0, 1.6)
PRIOR_WEIGHT = 2.0
MIN_PREFILL_TOKENS = 16  # prefill always progresses, however slow the decodes alone are


class StepCostModel:
    """Least squares over (1, decodes, prefill_tokens) -> step ms with exponential forgetting
    (`decay` per observation), so the fit follows the machine as its load changes."""

    def __init__(self, decay: float = 0.98, prior: tuple[float, float, float] = PRIOR, prior_weight: float = PRIOR_WEIGHT):
        self.decay = decay
        self.prior = prior
        # Ridge toward the prior, scaled per feature so that it weighs like prior_weight steps
        # of typical size. It starts in the sums and fades with them; a small floor stays so
        # that a feature that stops varying (no prefill for a while) keeps a sane coefficient.
        scale = (1.0, 8.0, 256.0)
        self._floor = [1e-3 * prior_weight * s * s for s in scale]
        self._xtx = [[prior_weight * scale[i] ** 2 if i == j else 0.0 for j in range(3)] for i in range(3)]
        self._xty = [prior_weight * scale[i] ** 2 * prior[i] for i in range(3)]
        self.observations = 0
        self._coefficients = prior
        self._stale = False  # observed since the last fit: refitted when next read

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c), fitted to every step observed so far (a step's engine reads them only
        under a step-time target, so the fit waits for a reader)."""
        if self._stale:
            self._coefficients, self._stale = self._solve(), False
        return self._coefficients

    @coefficients.setter
    def coefficients(self, value: tuple[float, float, float]) -> None:
        self._coefficients, self._stale = tuple(value), False

    def observe(self, decodes: int, prefill_tokens: int, step_ms: float) -> None:
        """Record one measured step (refitted when the coefficients are next read)."""
        x = (1.0, float(decodes), float(prefill_tokens))
        for i in range(3):
            self._xty[i] = self.decay * self._xty[i] + x[i] * step_ms
            for j in range(3):
                self._xtx[i][j] = self.decay * self._xtx[i][j] + x[i] * x[j]
        self.observations += 1
        self._stale = True

    def predict_ms(self, decodes: int, prefill_tokens: int) -> float:
        a, b, c = self.coefficients
        return a + b * decodes + c * prefill_tokens

    def prefill_budget(self, decodes: int, target_ms: float, max_tokens: int) -> int:
        """Most prefill tokens a step with `decodes` decoding requests may add and stay under
        target_ms (at least MIN_PREFILL_TOKENS, at most max_tokens). Where the decodes alone
        take half the target or more, prefill still gets as much time as they take, so an
        unreachable target stretches steps at most twice instead of starving prompts."""
        a, b, c = self.coefficients
        base = a + b * decodes
        room = max(target_ms, 2 * base) - base
        tokens = int(room / c) if c > 0 else max_tokens
        return max(MIN_PREFILL_TOKENS, min(max_tokens, tokens))

    def deadline_budget(self, pending: list[tuple[float, int]], decodes: int, step_tokens: int, max_tokens: int) -> int:
        """Prefill tokens for the next step so that pending prompts, served in the given order,
        meet their deadlines. `pending`: (ms until its first token is due, prompt tokens left)
        per prompt; `step_tokens`: what a step under the step-time target may take. While
        steps of that size finish every prompt in time, that is the answer; a prompt they
        would finish late is computed now with everything before it, in full-size chunks: one
        long step at once instead of a slow start and a long step anyway, later. The caller
        counts a waiting prompt's tokens before any prefix-cache hit is known: with hits this
        errs toward computing sooner, never toward a late first token."""
        a, b, c = self.coefficients
        step_ms = a + b * decodes + c * step_tokens
        need, total = step_tokens, 0
        for ms_left, tokens in pending:
            total += tokens
            if -(-total // step_tokens) * step_ms > ms_left:
                need = total
        return min(max_tokens, need)

    def _solve(self) -> tuple[float, float, float]:
        m = [[self._xtx[i][j] + (self._floor[i] if i == j else 0.0) for j in range(3)] for i in range(3)]
        v = [self._xty[i] + self._floor[i] * self.prior[i] for i in range(3)]
        solved = _solve3(m, v)
        if solved is None:
            return self._coefficients
        a, b, c = solved
        return (max(a, 0.0), max(b, 0.0), max(c, 1e-6))


def _solve3(m: list[list[float]], v: list[float]) -> tuple[float, float, float] | None:
    """Gaussian elimination with partial pivoting on a 3x3 system; None if singular."""
    rows = [m[i][:] + [v[i]] for i in range(3)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-12:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(3):
            if r != col:
                f = rows[r][col] / rows[col][col]
                rows[r] = [x - f * y for x, y in zip(rows[r], rows[col])]
    return tuple(rows[i][3] / rows[i][i] for i in range(3))  # type: ignore[return-value]
