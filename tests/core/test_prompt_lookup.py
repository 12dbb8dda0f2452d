"""The drafter's forced text (jump-forward) on the scheduling side: how much of the text a
grammar forces is drafted, following what verification accepted."""

from __future__ import annotations

from radixserve.core.prompt_lookup import MAX_FORCED_TOKENS, PromptLookupDrafter
from radixserve.core.request import Request
from radixserve.sampling_params import SamplingParams

FORCED_TEXT = list(range(1000, 1000 + 2 * MAX_FORCED_TOKENS))  # what the grammar forces next, as tokens


def _constrained(rid: str = "r") -> Request:
    request = Request(rid, [1, 2, 3], SamplingParams(max_tokens=200, temperature=0.0), 3 + 200)
    request.grammar = object()  # the drafter never looks inside: the engine's callback does
    return request


def _drafter(forced: list[int] = FORCED_TEXT) -> PromptLookupDrafter:
    drafter = PromptLookupDrafter(4, 1, 3, default_on=False)
    drafter.forced = lambda request, k: forced[:k]
    return drafter


def test_forced_text_is_drafted_whole_up_to_the_cap_while_it_is_accepted():
    drafter, request = _drafter(), _constrained()
    assert drafter.propose(request, 200) == FORCED_TEXT[:MAX_FORCED_TOKENS]
    drafter.record(request, MAX_FORCED_TOKENS, MAX_FORCED_TOKENS)
    assert len(drafter.propose(request, 200)) == MAX_FORCED_TOKENS
    assert drafter.propose(request, 5) == FORCED_TEXT[:5]  # never past the request's room
    assert drafter.stats.forced_drafts == 1 and drafter.stats.forced_accepted == MAX_FORCED_TOKENS


def test_forced_drafts_the_model_spells_otherwise_shrink_to_one_past_the_accepted_and_grow_back():
    drafter, request = _drafter(), _constrained()
    drafter.propose(request, 200)
    drafter.record(request, MAX_FORCED_TOKENS, 1)  # the model spelt the text otherwise after one token
    assert drafter.propose(request, 200) == FORCED_TEXT[:2]
    drafter.record(request, 2, 0)
    assert drafter.propose(request, 200) == FORCED_TEXT[:1]
    lengths = []
    for _ in range(7):  # accepted whole each time: doubles back to the cap
        draft = drafter.propose(request, 200)
        drafter.record(request, len(draft), len(draft))
        lengths.append(len(draft))
    assert lengths == [1, 2, 4, 8, 16, 32, 32]
    assert drafter.stats.forced_tokens == MAX_FORCED_TOKENS + 2 + sum(lengths)


def test_a_short_forced_text_accepted_whole_keeps_the_cap():
    drafter, request = _drafter(FORCED_TEXT[:3]), _constrained()
    for _ in range(3):
        assert drafter.propose(request, 200) == FORCED_TEXT[:3]
        drafter.record(request, 3, 3)
    drafter.forced = lambda request, k: FORCED_TEXT[:k]  # then a long forced stretch
    assert len(drafter.propose(request, 200)) == MAX_FORCED_TOKENS


def test_each_request_has_its_own_forced_length():
    drafter, cut, whole = _drafter(), _constrained("cut"), _constrained("whole")
    drafter.propose(cut, 200)
    drafter.propose(whole, 200)
    drafter.record(cut, MAX_FORCED_TOKENS, 0)
    drafter.record(whole, MAX_FORCED_TOKENS, MAX_FORCED_TOKENS)
    assert len(drafter.propose(cut, 200)) == 1 and len(drafter.propose(whole, 200)) == MAX_FORCED_TOKENS
