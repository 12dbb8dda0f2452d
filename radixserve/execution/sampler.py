"""Sampler: one batched pass from logits to the next token of every sampling request.

Sampling inverts the distribution's CDF at one uniform draw a row: the first token whose
cumulative probability (summed in float64) passes u times the row's total, which draws from
p exactly. One draw a row instead of a noise value per token (the exponential race this
replaced drew 262,144 exponentials a step for Gemma 3's vocabulary: ~5 ms of a ~25 ms decode
step on one thread; the search is ~0.3 ms). A request with a seed draws its uniform from a
generator seeded by (seed, output position), so its tokens do not depend on what else is in
the batch, nor on whether it was preempted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixserve.core.draft_tree import children, is_chain
from radixserve.outputs import TokenLogprob
from radixserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request."""

    params: SamplingParams
    token_ids: list[int]  # prompt then output, the request's own list (not copied)
    num_prompt_tokens: int
    stop_token_ids: list[int]  # ids masked while fewer than min_tokens were generated
    grammar: Any = None  # an xgrammar matcher that masks what the constraint forbids

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [len(rows), vocab] float32. Returns token ids and (when asked) logprobs."""
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = _apply_grammars(logits, rows)
        logits = self._apply_penalties(logits, rows)
        logits = self._apply_min_tokens(logits, rows)
        token_list = argmax_rows(logits)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            for i, token in zip(sampled, self._sample(logits[index], [rows[i] for i in sampled]).tolist()):
                token_list[i] = token
        return token_list, self._logprobs(raw_logprobs, token_list, rows)

    def verify(self, logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]],
               parents: list[list[int]] | None = None) -> list[list[int]]:
        """Check each request's draft against the model: logits holds len(draft) + 1 rows per
        request (row i scores the token after draft[:i]). Returns the tokens each request
        appends: the longest accepted prefix of its draft, then one token sampled after it.

        A draft tree (`parents[i]`, core/draft_tree.py; empty or a chain: as below) has row 0
        score the token after the request's last and row 1 + j the token after node j's path;
        the tokens appended are an accepted path's and one sampled after it (_greedy_tree,
        _sampled_tree). Trees carry no grammar (constrained drafts stay chains).

        Greedy: a draft token is accepted when it is the argmax. Sampled (rejection rule for
        a deterministic draft, exact in distribution): draft token d is accepted with
        probability p(d); on rejection the token is drawn from p with d removed and
        renormalised; when all are accepted the last row gives a bonus token from p.
        A constrained request's rows are masked by its grammar state after the draft tokens
        before each (so a forced draft appends what masked decoding would). Requests here have
        no penalties, logprobs or seed (see core/prompt_lookup.py)."""
        counts = [len(d) + 1 for d in drafts]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        trees = {i: p for i, p in enumerate(parents or []) if p and not is_chain(p)}
        if any(rows[i].grammar is not None for i in trees):
            raise ValueError("a constrained request's draft must be a chain")
        logits = _apply_draft_grammars(logits, rows, drafts, starts)
        targets = argmax_rows(logits)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        probs = accept = None
        if sampled:
            index = [starts[i] + j for i in sampled for j in range(counts[i])]
            expanded = [rows[i] for i in sampled for _ in range(counts[i])]
            probs = torch.zeros_like(logits)
            probs[index] = self._probs(logits[index], expanded)
            chains = [[] if i in trees else d for i, d in enumerate(drafts)]
            accept = self._accept_flags(probs, chains, starts)
        out = []
        for i, draft in enumerate(drafts):
            rows_i = slice(starts[i], starts[i] + counts[i])
            if i in trees and i not in sampled:
                tokens = _greedy_tree(draft, trees[i], targets[rows_i])
            elif i in trees:
                tokens = self._sampled_tree(draft, trees[i], probs[rows_i])
            elif i not in sampled:
                tokens = _greedy_prefix(draft, targets[starts[i]:starts[i] + counts[i]])
            else:
                tokens = self._sampled_prefix(draft, probs[starts[i]:starts[i] + counts[i]], accept[i])
            out.append(tokens)
        return out

    # ---- helpers ----------------------------------------------------------------

    def _accept_flags(self, probs: torch.Tensor, drafts: list[list[int]], starts: list[int]) -> dict[int, list[bool]]:
        """u < p(d) for every draft token of the sampled requests, one batched draw."""
        rows, cols, owners = [], [], []
        for i, draft in enumerate(drafts):
            for j, d in enumerate(draft):
                rows.append(starts[i] + j)
                cols.append(d)
                owners.append(i)
        p = probs[rows, cols] if rows else probs.new_zeros(0)
        u = torch.rand(len(rows), generator=self.generator, device=self.device)
        flags: dict[int, list[bool]] = {i: [] for i in range(len(drafts))}
        for owner, ok in zip(owners, (u < p).tolist()):
            flags[owner].append(ok)
        return flags

    def _sampled_tree(self, draft: list[int], parents: list[int], probs: torch.Tensor) -> list[int]:
        """The multi-candidate rejection rule for deterministic drafts, exact in distribution:
        at a node (row 0: the root) its children are tried in order, child d accepted with
        probability p(d) under the node's distribution with the children tried before removed
        and renormalised; the first accepted is appended and its own children tried next; when
        all are rejected (or it has none) a token is drawn from what remains."""
        kids = children(parents)
        out: list[int] = []
        node = -1
        while True:
            row = probs[node + 1]
            total, rejected = float(row.sum(dtype=torch.float64)), []
            for child in kids.get(node, []):
                p = float(row[draft[child]])
                u = float(torch.rand(1, generator=self.generator, device=self.device, dtype=torch.float64))
                if u * total < p:
                    break
                total -= p
                rejected.append(draft[child])
            else:
                residual = row.clone()
                residual[rejected] = 0.0
                return out + [self._race(residual)]
            out.append(draft[child])
            node = child

    def _sampled_prefix(self, draft: list[int], probs: torch.Tensor, accepted: list[bool]) -> list[int]:
        for j, d in enumerate(draft):
            if not accepted[j]:
                residual = probs[j].clone()
                residual[d] = 0.0
                return draft[:j] + [self._race(residual)]
        return list(draft) + [self._race(probs[len(draft)])]

    def _race(self, probs: torch.Tensor) -> int:
        """One token from an (unnormalised) probability row."""
        u = torch.rand(1, generator=self.generator, device=self.device, dtype=torch.float64)
        return int(_invert_cdf(probs[None], u)[0])

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        penalized = [i for i, r in enumerate(rows) if r.params.uses_penalties]
        if not penalized:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in penalized:  # rows with penalties are rare; each is a few vectorized ops
            p = rows[i].params
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(rows[i].token_ids, device=row.device)
                values = row[seen]
                row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
            if rows[i].num_output_tokens and (p.frequency_penalty or p.presence_penalty):
                out = torch.tensor(rows[i].output_token_ids, device=row.device)
                counts = torch.bincount(out, minlength=vocab).to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    def _apply_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        rows_below = [
            i for i, r in enumerate(rows) if r.num_output_tokens < r.params.min_tokens and r.stop_token_ids
        ]
        if not rows_below:
            return logits
        logits = logits.clone()
        for i in rows_below:
            logits[i, rows[i].stop_token_ids] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        return _invert_cdf(self._probs(logits, rows), self._uniforms(rows))

    @staticmethod
    def _probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution each row samples from: temperature, top-k/top-p, min-p (normalised)."""
        temperature = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        logits = logits / temperature[:, None]
        if any(r.params.top_k or r.params.top_p < 1.0 for r in rows):
            logits = _top_k_top_p(logits, rows)
        probs = torch.softmax(logits, dim=-1)
        if any(r.params.min_p > 0 for r in rows):
            min_p = torch.tensor([r.params.min_p for r in rows], device=logits.device)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One float64 uniform in [0, 1) a row: a seeded row's from its (seed, position) generator."""
        u = torch.empty(len(rows), dtype=torch.float64, device=self.device)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), generator=self.generator, device=self.device, dtype=torch.float64)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                g = torch.Generator(self.device)
                g.manual_seed(_mix(r.params.seed, r.num_output_tokens))
                u[i] = torch.rand(1, generator=g, device=self.device, dtype=torch.float64)[0]
        return u

    @staticmethod
    def _logprobs(
        raw: torch.Tensor | None, tokens: list[int], rows: list[SamplingRow]
    ) -> list[TokenLogprob | None]:
        if raw is None:
            return [None] * len(rows)
        out: list[TokenLogprob | None] = []
        for i, r in enumerate(rows):
            k = r.params.logprobs
            if k is None:
                out.append(None)
                continue
            chosen = float(raw[i, tokens[i]])
            top: list[tuple[int, float]] = []
            if k:
                values, ids = raw[i].topk(k)
                top = list(zip(ids.tolist(), values.tolist()))
            out.append(TokenLogprob(tokens[i], chosen, top))
        return out


_CDF_BLOCK = 512  # the CDF is searched in two levels: sums of blocks of this many tokens, then one block


def _invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of (unnormalised, non-negative) probs, the first token whose cumulative sum
    passes u times the row's total: token i with probability p_i / total (a zero p_i adds no
    width, so it is never drawn). In float64, over block sums and then within the one block
    the draw lands in (a cumsum of the whole row in float64 cost ~1.5 ms at 262k tokens)."""
    rows, vocab = probs.shape
    pad = (-vocab) % _CDF_BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    blocks = blocks.reshape(rows, -1, _CDF_BLOCK)
    csum = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [rows, blocks]
    target = (u.to(torch.float64) * csum[:, -1])[:, None]
    b = _first_past(csum, target)
    before = torch.where(b > 0, csum.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    inner = blocks[torch.arange(rows, device=probs.device), b[:, 0]].double().cumsum(dim=-1)
    j = _first_past(inner, target - before)
    return (b[:, 0] * _CDF_BLOCK + j[:, 0]).clamp_(max=vocab - 1)


def _first_past(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: the first index whose cdf exceeds target, or (when rounding put target at or
    past the end) the first that reaches the row's last value: never one that adds nothing."""
    past = torch.searchsorted(cdf, target, right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)
    return torch.minimum(past, last)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's first index of its largest value (a NaN counts as largest), as torch's
    argmax. Float32 rows on the host go through numpy's, which is vectorized: torch's took
    42 us for one 49,152-entry row, numpy's 3 (a step at batch 1 takes ~4.5 ms)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def _greedy_tree(draft: list[int], parents: list[int], targets: list[int]) -> list[int]:
    """From the root, the child whose token is the argmax of its parent's row (row 0: the
    root's, row 1 + j: node j's), while there is one; then that argmax (the bonus token)."""
    kids = children(parents)
    out: list[int] = []
    node = -1
    while True:
        target = targets[node + 1]
        node = next((c for c in kids.get(node, []) if draft[c] == target), None)
        out.append(target)
        if node is None:
            return out


def _greedy_prefix(draft: list[int], targets: list[int]) -> list[int]:
    """Draft tokens while they equal the argmax, then the argmax where they first differ
    (or after the last one)."""
    for j, d in enumerate(draft):
        if targets[j] != d:
            return draft[:j] + [targets[j]]
    return list(draft) + [targets[len(draft)]]


def _apply_grammars(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    constrained = [(i, r.grammar) for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return logits
    from radixserve.execution.constrained import apply_grammar_masks

    logits = logits.clone()
    apply_grammar_masks(logits, constrained)
    return logits


def _apply_draft_grammars(logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]],
                          starts: list[int]) -> torch.Tensor:
    constrained = [(starts[i], r.grammar, drafts[i]) for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return logits
    from radixserve.execution.constrained import apply_draft_masks

    logits = logits.clone()
    apply_draft_masks(logits, constrained)
    return logits


# top-k / top-p first look at the 1,024 most likely tokens, then at 16,384 (on a 262k
# vocabulary a full sort costs ~20x the first partial selection and ~6x the second); the
# candidates decide whenever every row's cut lies among them.
_CANDIDATES = (1024, 16384)


def _top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude. The most likely candidates, in order,
    decide it where each row keeps only tokens among them (its top_k fits, or its nucleus
    mass is reached inside them), the fewest candidates that do; otherwise one full sort."""
    vocab = logits.shape[1]
    top_k = torch.tensor([r.params.top_k or vocab for r in rows], device=logits.device)
    top_p = torch.tensor([r.params.top_p for r in rows], device=logits.device)
    untouched = (top_k >= vocab) & (top_p >= 1.0)  # rows that cut nothing keep every token as it is
    out = None
    candidates = [n for n in _CANDIDATES if vocab > 2 * n]
    row_lse = logits.logsumexp(dim=-1) if candidates else None
    for n in candidates:
        values, order = logits.topk(n, dim=-1)
        kept, complete = _cut_sorted(values, top_k, top_p, row_lse)
        if bool((complete | untouched).all()):
            out = torch.full_like(logits, float("-inf")).scatter_(1, order, kept)
            break
    if out is None:
        values, order = logits.sort(dim=-1, descending=True)
        kept, _ = _cut_sorted(values, top_k, top_p, None)
        out = torch.empty_like(logits).scatter_(1, order, kept)
    return torch.where(untouched[:, None], logits, out) if bool(untouched.any()) else out


def _cut_sorted(values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                row_lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted logits (all of a row's, or its leading candidates with `row_lse` the whole
    row's log-sum-exp) with what top-k and top-p drop set to -inf; and per row whether
    nothing past the given values could survive."""
    ranks = torch.arange(values.shape[1], device=values.device)[None, :]
    k_cut = ranks >= top_k[:, None]
    values = values.masked_fill(k_cut, float("-inf"))
    if row_lse is None:
        probs = torch.softmax(values, dim=-1)
    else:  # normalised over the row's top_k where that fits, else over the whole row
        fits = top_k <= values.shape[1]
        norm = torch.where(fits, values.logsumexp(dim=-1), row_lse)
        probs = (values - norm[:, None]).exp()
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    nucleus = top_p < 1.0  # top_p 1 cuts nothing, though a float32 cumsum may reach 1 early
    # the first always survives: a top_p below float32's range (5e-324 is 0 there) cut every token
    values = values.masked_fill((before >= top_p[:, None]) & nucleus[:, None] & (ranks > 0), float("-inf"))
    complete = (top_k <= values.shape[1]) | (nucleus & (probs.sum(dim=-1) >= top_p))
    return values, complete


def _mix(seed: int, position: int) -> int:
    """A per-(seed, position) generator seed; a splitmix64-style mix keeps nearby seeds apart."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return (z ^ (z >> 31)) % (1 << 63)
