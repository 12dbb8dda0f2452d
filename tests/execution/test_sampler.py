"""Sampler on hand-made logits: exact masks, penalties, seeds and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve.execution.sampler import Sampler, SamplingRow, argmax_rows
from radixserve.sampling_params import SamplingParams


def row(prompt=(), output=(), stop=(), **params):
    return SamplingRow(SamplingParams(**params), list(prompt) + list(output), len(prompt), list(stop))


def sample_many(logits, n=2000, **params):
    sampler = Sampler(seed=0)
    counts = torch.zeros(logits.shape[-1])
    for _ in range(n):
        tokens, _ = sampler(logits[None].clone(), [row(**params)])
        counts[tokens[0]] += 1
    return counts / n


def test_greedy_is_argmax_and_sampling_rows_do_not_disturb_it():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    tokens, _ = Sampler()(logits, [row(temperature=0.0), row(temperature=1.0, seed=1), row(temperature=0.0)])
    assert tokens[0] == 1 and tokens[2] == 2


def test_argmax_rows_is_torchs_argmax_on_ties_nans_masked_rows_and_strided_views():
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(0))
    logits[1, [7, 900, 30000]] = 50.0  # a tie: the first index
    logits[2, [11, 4000]] = float("nan")  # a NaN counts as largest: the first
    logits[3] = float("-inf")  # a row masked whole (a grammar left nothing): index 0
    logits[4, -1] = float("inf")
    for view in (logits, logits[:, ::3], logits[::2], logits[:0]):
        assert argmax_rows(view) == view.argmax(dim=-1).tolist()
    assert argmax_rows(logits)[1:4] == [7, 11, 0] and argmax_rows(logits)[4] == 49151
    for dtype in (torch.float64, torch.bfloat16):  # torch's own path
        assert argmax_rows(logits[:1].to(dtype)) == logits[:1].to(dtype).argmax(dim=-1).tolist()


def test_sampling_follows_the_distribution():
    freq = sample_many(torch.tensor([0.0, math.log(3.0)]), temperature=1.0)
    assert freq[1] == pytest.approx(0.75, abs=0.03)


def test_temperature_sharpens():
    freq = sample_many(torch.tensor([0.0, math.log(3.0)]), temperature=0.5)  # 1 : 9
    assert freq[1] == pytest.approx(0.9, abs=0.03)


def test_top_k_top_p_min_p_exclude_exactly_the_tail():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert set(sample_many(logits, top_k=2).nonzero().flatten().tolist()) == {0, 1}
    assert set(sample_many(logits, top_p=0.79).nonzero().flatten().tolist()) == {0, 1}  # 0.5 + 0.3 >= 0.79
    assert set(sample_many(logits, top_p=0.81).nonzero().flatten().tolist()) == {0, 1, 2}
    assert set(sample_many(logits, min_p=0.35).nonzero().flatten().tolist()) == {0, 1}  # p >= 0.175
    assert sample_many(logits, top_k=1, n=200)[0] == 1.0


@pytest.mark.parametrize("top_p", [1e-12, 1e-30, 5e-324])
@pytest.mark.parametrize("vocab", [4, 96, 3000])  # the sorted path, and the candidates' path past 2 x 1,024
def test_a_top_p_too_small_for_float32_keeps_the_most_likely_token(top_p, vocab):
    """5e-324 is 0 in float32: no token's mass above it is below it, yet the first always survives."""
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab))
    tokens, _ = Sampler(seed=0)(logits.clone(), [row(top_p=top_p, temperature=1.0, seed=s) for s in range(3)])
    assert tokens == logits.argmax(dim=-1).tolist()


def test_seed_gives_the_same_token_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = dict(temperature=1.0, seed=42)
    alone, _ = Sampler(seed=1)(logits[2:3].clone(), [row(output=[1, 2], **params)])
    batch, _ = Sampler(seed=7)(logits.clone(), [row(temperature=1.0), row(temperature=0.0), row(output=[1, 2], **params), row(temperature=0.7)])
    assert batch[2] == alone[0]
    # The draw depends on the output position, not on a hidden generator state.
    draws = {Sampler()(logits[2:3].clone(), [row(output=[0] * k, **params)])[0][0] for k in range(20)}
    assert len(draws) > 1


def test_penalties_change_logits_exactly():
    sampler = Sampler()
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    # repetition: positive logits divided, negative multiplied, for prompt and output tokens
    r = row(prompt=[0], output=[1], temperature=0.0, repetition_penalty=2.0)
    out = sampler._apply_penalties(logits, [r])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    # frequency counts output occurrences; presence is a flat charge; the prompt is exempt
    r = row(prompt=[3], output=[2, 2, 0], temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = sampler._apply_penalties(logits, [r])
    assert out.tolist() == [[2.0 - 0.5 - 0.25, -2.0, 1.0 - 1.0 - 0.25, 0.5]]
    assert logits.tolist() == [[2.0, -2.0, 1.0, 0.5]]  # the caller's tensor is untouched


def test_min_tokens_masks_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    blocked, _ = Sampler()(logits.clone(), [row(output=[2], stop=[1], temperature=0.0, min_tokens=2)])
    assert blocked == [2]
    allowed, _ = Sampler()(logits.clone(), [row(output=[2, 2], stop=[1], temperature=0.0, min_tokens=2)])
    assert allowed == [1]


def test_logprobs_are_raw_log_softmax_with_top_alternatives():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    tokens, lps = Sampler()(logits.clone(), [row(temperature=0.0, logprobs=2, repetition_penalty=5.0, prompt=[1])])
    reference = torch.log_softmax(logits[0], -1)
    assert lps[0].token_id == tokens[0]
    assert lps[0].logprob == pytest.approx(float(reference[tokens[0]]))
    assert [t for t, _ in lps[0].top] == [1, 2]
    _, none = Sampler()(logits.clone(), [row(temperature=0.0)])
    assert none == [None]


@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])  # flat (the full sort decides) to peaked (the candidates do)
def test_a_large_vocabulary_keeps_exactly_what_one_full_sort_keeps(spread):
    """Gemma 3's 262k vocabulary: top-k/top-p look at the leading candidates first; the tokens
    kept, and their logits, are exactly those of a full sort, row by row (untouched rows too)."""
    from radixserve.execution.sampler import _cut_sorted, _top_k_top_p

    torch.manual_seed(int(spread * 10))
    vocab = 262_144
    logits = torch.randn(6, vocab) * spread
    rows = [row(top_p=0.9), row(top_k=50), row(), row(top_k=20, top_p=0.5), row(top_k=5000), row(top_p=0.999)]
    got = _top_k_top_p(logits, rows)
    values, order = logits.sort(dim=-1, descending=True)
    top_k = torch.tensor([r.params.top_k or vocab for r in rows])
    top_p = torch.tensor([r.params.top_p for r in rows])
    kept, _ = _cut_sorted(values, top_k, top_p, None)
    want = torch.empty_like(logits).scatter_(1, order, kept)
    want[2] = logits[2]  # a row that asks for no cut keeps every token (a full cumsum may round past 1)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], want[~torch.isinf(want)])
    assert torch.equal(got[2], logits[2]) and int((~torch.isinf(got[1])).sum()) == 50


def test_a_nucleus_past_the_first_candidates_is_cut_without_a_full_sort(monkeypatch):
    """top-p whose nucleus needs ~7,000 of 262k tokens (past the first 1,024 candidates) is
    decided by the larger partial selection, never a sort of the whole vocabulary, and keeps
    exactly what a full sort keeps."""
    from radixserve.execution.sampler import _CANDIDATES, _cut_sorted, _top_k_top_p

    torch.manual_seed(7)
    vocab = 262_144
    logits = torch.randn(2, vocab) * 0.5
    logits[:, :8000] += 8.0  # nearly all the mass on 8,000 tokens
    rows = [row(top_p=0.9), row(top_p=0.5, top_k=3000)]
    values, order = logits.sort(dim=-1, descending=True)
    kept, _ = _cut_sorted(values, torch.tensor([vocab, 3000]), torch.tensor([0.9, 0.5]), None)
    want = torch.empty_like(logits).scatter_(1, order, kept)
    assert _CANDIDATES[0] < int((~torch.isinf(want[0])).sum()) < _CANDIDATES[-1]

    def no_sort(*args, **kwargs):
        raise AssertionError("a full sort of the vocabulary")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    got = _top_k_top_p(logits, rows)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], want[~torch.isinf(want)])


def test_the_cdf_draw_skips_zero_probability_tokens_at_either_end():
    from radixserve.execution.sampler import _invert_cdf

    probs = torch.tensor([[0.0, 0.0, 0.25, 0.0, 0.75, 0.0, 0.0]])
    ends = torch.tensor([0.0, 0.25 - 1e-12, 0.25, 1.0 - 1e-16], dtype=torch.float64)
    got = [int(_invert_cdf(probs, u[None])[0]) for u in ends]
    assert got == [2, 2, 4, 4]


def test_sampling_a_large_vocabulary_follows_the_distribution():
    vocab = 262_144
    logits = torch.full((vocab,), -30.0)
    logits[7] = 0.0
    logits[vocab - 1] = math.log(3.0)  # 1 : 3 between the first and the last id, the rest ~e-30
    logits[100:200] = -2.0  # 100 tokens of e^-2 each: ~0.0327 of the mass together
    total = 1 + 3 + 100 * math.exp(-2.0)
    freq = sample_many(logits, n=3000, temperature=1.0)
    assert freq[7] == pytest.approx(1 / total, abs=0.03)
    assert freq[vocab - 1] == pytest.approx(3 / total, abs=0.03)
    assert freq[100:200].sum() == pytest.approx(100 * math.exp(-2.0) / total, abs=0.015)
    assert freq.sum() == pytest.approx(1.0) and freq[200:vocab - 1].sum() == 0


# ---- draft trees (core/draft_tree.py) ----------------------------------------------------

# node 0 (token 1) and node 1 (token 2) follow the root, node 2 (token 3) follows node 0,
# node 3 (token 0) follows node 1
TREE_TOKENS, TREE_PARENTS = [1, 2, 3, 0], [-1, -1, 0, 1]


def test_greedy_tree_takes_the_branch_the_argmax_names():
    logits = torch.full((5, 5), -5.0)
    logits[0, 2] = 5.0  # the root's argmax is token 2: node 1, a side branch
    logits[2, 0] = 5.0  # after node 1: token 0, node 3
    logits[4, 4] = 5.0  # after node 3: token 4, the bonus
    logits[1, 3] = logits[3, 1] = 5.0  # node 0's and node 2's rows: not on the path
    row_ = row(temperature=0.0)
    assert Sampler().verify(logits, [row_], [TREE_TOKENS], [TREE_PARENTS]) == [[2, 0, 4]]
    logits[0] = -5.0
    logits[0, 4] = 5.0  # no child of the root: its argmax alone
    assert Sampler().verify(logits, [row_], [TREE_TOKENS], [TREE_PARENTS]) == [[4]]
    # a chain given as parents verifies as the chain rule does
    chain_logits = torch.full((3, 5), -5.0)
    chain_logits[0, 1] = chain_logits[1, 3] = chain_logits[2, 2] = 5.0
    assert Sampler().verify(chain_logits, [row_], [[1, 3]], [[-1, 0]]) == [[1, 3, 2]]


def test_sampled_tree_is_exact_in_distribution():
    """10,000 verifications of one tree: the first token follows the root's distribution and the
    second, after each accepted branch, that branch's row; trying the root's second child with
    its plain probability (no renormalisation after the first's rejection) would give token 2
    0.6 * 0.3 = 0.18, not 0.3."""
    root = torch.tensor([0.1, 0.4, 0.3, 0.1, 0.1])
    after_1 = torch.tensor([0.2, 0.2, 0.2, 0.3, 0.1])  # node 0's row (its child: token 3)
    after_2 = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2])  # node 1's row (its child: token 0)
    after_3 = torch.tensor([0.05, 0.05, 0.3, 0.3, 0.3])  # node 2's row (a leaf)
    after_0 = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1])  # node 3's row (a leaf)
    logits = torch.stack([root, after_1, after_2, after_3, after_0]).log()
    n = 10000
    sampler = Sampler(seed=3)
    outs = sampler.verify(logits.repeat(n, 1), [row(temperature=1.0)] * n, [TREE_TOKENS] * n, [TREE_PARENTS] * n)

    def close(count, total, p):
        assert abs(count - p * total) < 4.5 * math.sqrt(total * p * (1 - p)) + 1, (count, total, p)

    firsts = [o[0] for o in outs]
    for token in range(5):
        close(firsts.count(token), n, float(root[token]))
    for first, row_probs in ((1, after_1), (2, after_2)):
        seconds = [o[1] for o in outs if o[0] == first]
        for token in range(5):
            close(seconds.count(token), len(seconds), float(row_probs[token]))
    assert all(len(o) == 1 for o in outs if o[0] not in (1, 2))
    assert all(len(o) == 3 for o in outs if o[:2] in ([1, 3], [2, 0]))  # past an accepted leaf: a bonus
