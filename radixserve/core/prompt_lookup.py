"""Prompt-lookup drafting: propose the tokens that followed the latest earlier occurrence of
a request's last n-gram in its own prompt and output (no draft model; plain Python).

Which requests speculate: those with `params.speculative` True, or None while the engine's
`speculative` is on; never constrained requests (their masks follow the grammar token by
token), requests that want logprobs, use penalties, are still below min_tokens, or sample
with a seed (their noise is keyed by position; speculation would draw differently). A
request whose drafts stop paying (few accepted tokens per verification) pauses drafting
for a while, pausing longer each time. A request's draft length follows what it had accepted:
it starts short, doubles while whole drafts are accepted (a copied passage) up to num_tokens,
and falls to one past the accepted count when a draft is cut; within that, it is the length
that promises the most tokens per second from the step times measured here by rows and the
request's per-token acceptance (core/draft_length.py), and where no length pays (a large
batch, a low acceptance, rows that cost as much as steps) the request pauses drafting too.

Constrained requests jump forward instead (on unless `jump_forward` is off, whatever
`speculative` says): where the grammar forces the next text, `forced(request, k)` (the
engine's grammar factory) gives its tokens as the draft, verified under the grammar's masks
in one step. Forced text is usually accepted whole; where the model spells it otherwise (the
boundary, or markers its tokenizer splits differently), verification appends the model's own
token, and the request's next forced drafts shrink to one past what was accepted and double
back as they are accepted whole (no pause: forced text is drafted again at each step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from radixserve.core.draft_length import StepCosts, best_length, draft_lengths
from radixserve.core.request import Request

MIN_ACCEPTED = 0.5  # accepted tokens per verification below which drafting does not pay
MIN_TRIES = 4  # verifications before the rate is judged
PAUSE_STEPS = 16  # first pause (decode steps without drafting); doubles on each pause
MAX_PAUSE_STEPS = 512
EMA = 0.3  # weight of the newest verification in the running acceptance figure
# A request's first draft. Verifying 1 + 4 rows costs ~1.2x a 1-row step with the skinny
# kernel (2026-12-01); against 2: `bench_speculative` edits 1.86-1.88x vs 1.77-1.80x at batch 1,
# records (lower acceptance) 1.34x vs 1.33x, batch 8 unchanged within noise.
FIRST_LENGTH = 4
# Most tokens of forced text drafted at once: a tool call's `", "arguments": {"city": "` is
# ~10 tokens; verifying 32 rows costs well under two 1-row steps at batch 1.
MAX_FORCED_TOKENS = 32
PRIOR_ACCEPTS, PRIOR_TRIALS = 1.5, 2.0  # a request's per-token acceptance starts at 0.75


@dataclass
class _DraftState:
    tries: int = 0
    accepted_ema: float = 0.0
    paused: int = 0
    next_pause: int = PAUSE_STEPS
    length: int = FIRST_LENGTH  # draft length for the next step; follows what was accepted
    forced: bool = False  # the draft being verified is the grammar's forced text
    forced_length: int = 0  # most forced-text tokens to draft next (set at the first forced draft)
    from_tree: bool = False  # the last lookup's draft drew on the radix tree's sequences (suffix drafting)
    accepts: float = 0.0  # draft tokens accepted
    trials: float = 0.0  # draft tokens judged: the accepted ones and each draft's first rejected one
    parents: list[int] | None = None  # the last lookup's draft tree (core/draft_tree.py); None: a chain


@dataclass
class SpeculationStats:
    drafts: int = 0  # verifications (a request's draft checked in one step)
    draft_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # of those, accepted
    pauses: int = 0  # times a request stopped drafting for low acceptance
    forced_drafts: int = 0  # jump-forward verifications (not counted in drafts above)
    forced_tokens: int = 0  # forced-text tokens drafted
    forced_accepted: int = 0  # of those, accepted
    tree_drafts: int = 0  # drafts a cached sequence of the request's namespace contributed to (suffix drafting)
    branched_drafts: int = 0  # of `drafts`, those verified as a tree with branches (speculative_tree_width > 1)
    branch_hits: int = 0  # of those, the verifications that accepted a node off the tree's main chain

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def accepted_length(self) -> float:
        """Tokens a verification appends on average: its accepted draft tokens and the one after."""
        return (self.accepted_tokens + self.drafts) / self.drafts if self.drafts else 0.0


class PromptLookupDrafter:
    def __init__(self, num_tokens: int, ngram_min: int, ngram_max: int, default_on: bool):
        self.num_tokens = num_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.default_on = default_on
        self.stats = SpeculationStats()
        self._states: dict[str, _DraftState] = {}
        # (request, k) -> up to k tokens its grammar forces next; None: constrained requests never draft
        self.forced: Callable[[Request, int], list[int]] | None = None
        self.costs = StepCosts()  # decode step time by rows, as measured (core/draft_length.py)
        self.adaptive = True  # lengths from those costs; False: the acceptance rule alone
        self.decodes = 1  # requests the last decode step decoded

    def observe_step(self, decodes: int, rows: int, ms: float) -> None:
        """A decode-only step of `decodes` requests and `rows` rows (their drafts included) took ms."""
        self.decodes = max(1, decodes)
        self.costs.observe(rows, ms)

    def eligible(self, request: Request) -> bool:
        p = request.params
        wanted = p.speculative if p.speculative is not None else self.default_on
        return bool(wanted and request.grammar is None and _verifiable(request))

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to min(num_tokens, max_tokens) draft tokens for the request, or [], as if the last
        decode step's requests decoded beside it without drafts; for a constrained request, up
        to MAX_FORCED_TOKENS of its forced text."""
        return self.propose_step([(request, max_tokens)], self.decodes, max_tokens)[0]

    def propose_step(self, asks: list[tuple[Request, int]], decodes: int, budget: int) -> list[list[int]]:
        """Drafts for one step's decoding requests together (each with room for at most its
        max_tokens; `decodes` requests decode in all; at most `budget` draft tokens): forced
        text for constrained requests, then lengths for the others split by what a row costs
        at this batch and what each request accepts (core/draft_length.py). Requests that no
        length would serve are not looked up at all; one whose acceptance would not pay even
        decoding alone pauses."""
        drafts: list[list[int]] = [[] for _ in asks]
        wanting: list[tuple[int, _DraftState, int]] = []  # (ask index, state, cap)
        for i, (request, max_tokens) in enumerate(asks):
            room = min(max_tokens, budget)
            if room <= 0:
                continue
            if request.grammar is not None:
                drafts[i] = self._propose_forced(request, room)
                budget -= len(drafts[i])
                continue
            state = self._drafting_state(request)
            if state is not None:
                wanting.append((i, state, min(state.length, self.num_tokens, room)))
        if not wanting:
            return drafts
        forced = sum(len(d) for d in drafts)
        caps = [cap for _, _, cap in wanting]
        if self.adaptive:
            ps = [self._acceptance(state) for _, state, _ in wanting]
            caps = draft_lengths(ps, caps, decodes, self.costs, forced, budget)
            for (_, state, cap), p, allowed in zip(wanting, ps, caps):
                if allowed == 0 and best_length(p, 1, cap, self.costs) == 0:
                    self._pause(state)  # not even alone: stop drafting for a while
        found = [self._lookup(asks[i][0], cap) if cap > 0 else [] for (i, _, _), cap in zip(wanting, caps)]
        lengths = [len(d) for d in found]
        if self.adaptive and lengths != caps:  # some found less: split the rows again
            lengths = draft_lengths(ps, lengths, decodes, self.costs, forced, budget)
        for (i, state, _), draft, length in zip(wanting, found, lengths):
            drafts[i] = draft[:min(length, budget)]
            budget -= len(drafts[i])
            self.stats.tree_drafts += bool(drafts[i]) and state.from_tree
        return drafts

    def _drafting_state(self, request: Request) -> _DraftState | None:
        """The request's drafting state if it may draft this step (eligible, not paused)."""
        if not self.eligible(request):
            return None
        state = self._states.setdefault(request.request_id, _DraftState())
        state.forced = state.from_tree = False
        state.parents = None
        if state.paused > 0:
            state.paused -= 1
            if state.paused == 0:  # judge it afresh: what it accepted before weighs half
                state.accepts, state.trials = state.accepts / 2, state.trials / 2
            return None
        return state

    @staticmethod
    def _acceptance(state: _DraftState) -> float:
        """The request's per-token acceptance so far, from a prior of PRIOR_ACCEPTS / PRIOR_TRIALS."""
        return (state.accepts + PRIOR_ACCEPTS) / (state.trials + PRIOR_TRIALS)

    def _lookup(self, request: Request, k: int) -> list[int]:
        """Up to k draft tokens for the request (the drafting rule; subclasses draw elsewhere)."""
        return lookup(request.token_ids, k, self.ngram_min, self.ngram_max)

    def _propose_forced(self, request: Request, max_tokens: int) -> list[int]:
        if self.forced is None or not _verifiable(request):
            return []
        state = self._states.setdefault(request.request_id, _DraftState())
        draft = self.forced(request, min(max_tokens, state.forced_length or MAX_FORCED_TOKENS))
        state.forced = bool(draft)
        return draft

    def parents_of(self, request: Request) -> list[int] | None:
        """The draft tree of the request's last proposal (core/draft_tree.py), None for a chain."""
        state = self._states.get(request.request_id)
        return None if state is None or state.forced else state.parents

    def record(self, request: Request, proposed: int, accepted: int, path: list[int] | None = None,
               parents: list[int] | None = None) -> None:
        """A draft of `proposed` tokens was verified and `accepted` of them agreed; for a draft
        tree (its `parents`), the nodes accepted (`path`): it passed whole where the path ended
        at a leaf (nothing rejected below it), and its next node budget follows as a chain's
        length does."""
        state = self._states.get(request.request_id)
        if state is not None and state.forced:
            self.stats.forced_drafts += 1
            self.stats.forced_tokens += proposed
            self.stats.forced_accepted += accepted
            state.forced_length = _forced_length(state.forced_length or MAX_FORCED_TOKENS, proposed, accepted)
            return
        self.stats.drafts += 1
        self.stats.draft_tokens += proposed
        self.stats.accepted_tokens += accepted
        whole = accepted >= proposed
        if parents:
            self.stats.branched_drafts += 1
            self.stats.branch_hits += any(node != d for d, node in enumerate(path or []))
            whole = bool(path) and path[-1] not in parents
        state = self._states.setdefault(request.request_id, _DraftState())
        state.tries += 1
        # Verifying costs more per drafted token on a compute-bound device: draft one past
        # what was accepted last time; a whole draft accepted means a copied run: double.
        state.length = min(self.num_tokens, 2 * proposed if whole else accepted + 1)
        state.accepted_ema = accepted if state.tries == 1 else (1 - EMA) * state.accepted_ema + EMA * accepted
        state.accepts += accepted
        state.trials += accepted + (not whole)
        if state.tries >= MIN_TRIES and state.accepted_ema < MIN_ACCEPTED:
            self._pause(state)

    def _pause(self, state: _DraftState) -> None:
        state.paused = state.next_pause
        state.next_pause = min(2 * state.next_pause, MAX_PAUSE_STEPS)
        state.tries = 0
        self.stats.pauses += 1

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)


def _verifiable(request: Request) -> bool:
    """Whether a draft of the request can be verified: no logprobs or penalties (verification
    computes neither), min_tokens reached, and no seed unless greedy."""
    p = request.params
    return bool(p.logprobs is None and not p.uses_penalties and request.num_output_tokens >= p.min_tokens
                and (p.greedy or p.seed is None))


def lookup(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """The k tokens after the latest earlier occurrence of the longest suffix n-gram
    (ngram_max down to ngram_min) of `tokens`; [] if none occurs."""
    size = len(tokens)
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        pattern = tokens[size - n:]
        last = pattern[-1]
        # an occurrence ending at index e (inclusive) with e < size - 1, latest first
        e = size - 2
        while e >= n - 1:
            if tokens[e] == last and tokens[e - n + 1:e + 1] == pattern:
                return tokens[e + 1:e + 1 + k]
            e -= 1
    return []


def _forced_length(length: int, proposed: int, accepted: int) -> int:
    """The next forced draft's cap after one of `proposed` tokens had `accepted` agree: as
    drafts follow what was accepted, but kept while forced text is accepted whole (it is
    usually whole; a short one says nothing about the next). Where the model spells the
    forced text otherwise token after token (markers its tokenizer splits differently),
    verification rows would cost a step each for one token: the cap falls to one past what
    was accepted, and doubles back as whole drafts are accepted."""
    if accepted == proposed:
        return min(MAX_FORCED_TOKENS, max(length, 2 * proposed))
    return accepted + 1
