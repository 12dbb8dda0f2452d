"""Engine features SGLang programs rely on: stop_regex as a real stop condition, and
max_tokens=0 as a prefill-only request (prompt logprobs, cache warm-up, no token)."""

from __future__ import annotations

import pytest
import regex

from radixserve import Engine, SamplingParams
from tiny_models import hf_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPT = "List three colours of the rainbow, separated by commas:"


def assert_all_free(engine: Engine) -> None:
    engine.check_integrity()
    engine.flush_cache()
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.has_unfinished_requests()


def small_engine(directory, **options):
    defaults = dict(block_size=4, num_kv_blocks=256, chunked_prefill_size=7, max_num_batched_tokens=16)
    return Engine(str(directory), **{**defaults, **options})


# ---- stop_regex (the real model: stop conditions read text) ------------------------------


@pytest.fixture(scope="module")
def free_run(real_engine):
    """The greedy continuation of PROMPT with no stop condition: text and token ids."""
    out = real_engine.generate([PROMPT], SamplingParams(max_tokens=24, **GREEDY))[0]
    assert len(out.text) > 20
    return out


@pytest.mark.real_model
def test_stop_regex_cuts_at_the_earliest_match(real_engine, free_run):
    text = free_run.text
    late, early = text[12:18], text[6:9]
    cut = min(text.find(late), text.find(early))
    matched = text[cut : cut + (3 if text.find(early) == cut else 6)]
    patterns = [regex.escape(late), regex.escape(early)]
    out = real_engine.generate([PROMPT], SamplingParams(max_tokens=24, stop_regex=patterns, **GREEDY))[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:cut], "stop", matched)
    assert out.token_ids == free_run.token_ids[: len(out.token_ids)]  # stopped at the token that completed it
    kept = SamplingParams(max_tokens=24, stop_regex=patterns, include_stop_str_in_output=True, **GREEDY)
    assert real_engine.generate([PROMPT], kept)[0].text == text[: cut + len(matched)]
    real_engine.check_integrity()


@pytest.mark.real_model
def test_stop_regex_spanning_tokens_and_a_character_class(real_engine, free_run):
    text = free_run.text
    span = text[4:16]  # several tokens: the match begins tokens before the one that completes it
    out = real_engine.generate([PROMPT], SamplingParams(max_tokens=24, stop_regex=regex.escape(span), **GREEDY))[0]
    assert (out.text, out.stop_reason) == (text[: text.find(span)], span)
    comma = regex.search(r"\w+,", text)
    assert comma is not None, text
    out = real_engine.generate([PROMPT], SamplingParams(max_tokens=24, stop_regex=[r"\w+,"], **GREEDY))[0]
    assert (out.text, out.stop_reason) == (text[: comma.start()], comma.group())
    real_engine.check_integrity()


@pytest.mark.real_model
def test_streamed_text_never_shows_what_a_stop_regex_later_cuts(real_engine, free_run):
    text = free_run.text
    span = text[8:20]
    rid = real_engine.add_request(PROMPT, SamplingParams(max_tokens=24, stop_regex=[regex.escape(span)], **GREEDY))
    seen = []
    for _ in range(64):
        if not real_engine.has_unfinished_requests():
            break
        seen += [o for o in real_engine.step() if o.request_id == rid]
    final = seen[-1]
    assert final.finished and final.text == text[: text.find(span)]
    assert len(seen) > 3
    for partial in seen:
        assert final.text.startswith(partial.text), (partial.text, final.text)
    real_engine.check_integrity()


def test_stop_regex_finds_a_match_that_began_in_earlier_text():
    from radixserve.core.request import Request
    from radixserve.engine.output import find_stop_regex

    request = Request("r", [1], SamplingParams(stop_regex=[r"b+c", r"x\d"]), 10)
    request.output_text = "aaa" + "bbb" + "c tail x1"
    assert find_stop_regex(request) == "bbbc" and request.output_text == "aaa"
    request = Request("r", [1], SamplingParams(stop_regex=[r"b+c", r"x\d"], include_stop_str_in_output=True), 10)
    request.output_text = "x1 bbbc"
    assert find_stop_regex(request) == "x1" and request.output_text == "x1"
    request.output_text = "no match yet: bbb"
    assert find_stop_regex(request) is None and request.output_text == "no match yet: bbb"


# ---- max_tokens=0: prefill only (tiny model: token ids and logprobs) ---------------------


def test_prefill_only_gives_the_prompt_logprobs_of_a_normal_request(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prompt = list(range(3, 26))  # 23 tokens: 4 chunks of at most 7
    engine = small_engine(directory, enable_prefix_cache=False)
    normal = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3, **GREEDY))[0]
    before = engine.stats()["generated_tokens"]
    only = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=3, **GREEDY))[0]
    assert (only.token_ids, only.text, only.finish_reason, only.finished) == ([], "", "length", True)
    assert engine.stats()["generated_tokens"] == before
    assert only.prompt_logprobs[0] is None and normal.prompt_logprobs[0] is None
    for a, b in zip(only.prompt_logprobs[1:], normal.prompt_logprobs[1:]):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert_all_free(engine)


def test_prefill_only_leaves_its_prompt_cached(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prefix = list(range(40, 56))  # 16 tokens: 4 full blocks
    engine = small_engine(directory)
    warm = engine.generate([prefix], SamplingParams(max_tokens=0))[0]
    assert warm.token_ids == [] and warm.cached_tokens == 0
    assert engine.stats()["blocks_cached"] == 4  # every block, the last prompt token's included
    engine.check_integrity()
    follow = prefix + [7, 8, 9]
    out = engine.generate([follow], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert out.cached_tokens == 16
    assert out.token_ids == hf_greedy(directory, follow, 6)
    again = engine.generate([prefix], SamplingParams(max_tokens=0))[0]
    assert again.cached_tokens == 12  # a match never covers the block of the last prompt token
    assert_all_free(engine)


def test_prefill_only_beside_generating_requests_and_aborted(tiny_model_dir):
    directory = tiny_model_dir("llama")
    engine = small_engine(directory)
    gens = {engine.add_request(p, SamplingParams(max_tokens=5, **GREEDY)): p for p in ([1, 2, 3], list(range(9, 30)))}
    warm = [engine.add_request(p, SamplingParams(max_tokens=0)) for p in ([5], list(range(60, 80)))]
    doomed = engine.add_request(list(range(60, 92)), SamplingParams(max_tokens=0))
    first = engine.step()
    assert engine.abort(doomed)
    engine.check_integrity()
    done = {}
    for _ in range(100):
        for out in first or engine.step():
            if out.finished:
                assert out.request_id not in done  # each finishes exactly once
                done[out.request_id] = out
        first = []
        if not engine.has_unfinished_requests():
            break
    assert set(done) == set(gens) | set(warm)
    for rid, prompt in gens.items():
        assert done[rid].token_ids == hf_greedy(directory, prompt, 5)
    for rid in warm:
        assert done[rid].token_ids == [] and done[rid].finish_reason == "length"
    assert_all_free(engine)
