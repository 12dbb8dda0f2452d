"""Each step's output costs O(what the step added): its delta holds only the step's tokens,
their logprobs and the newly visible text; its cumulative fields are views fixed at the step,
built only when read, and equal to what the full copies of every step used to hold (stop
strings and stop_regex held back exactly as before), through logprobs, prompt logprobs,
speculative multi-token steps, several samples of one prompt and preemption."""

from __future__ import annotations

import random

import pytest

from radixserve import Engine, SamplingParams
from radixserve.core.prompt_lookup import PromptLookupDrafter
from radixserve.core.request import Request, RequestStatus
from radixserve.engine.output import OutputProcessor, stop_regex_holdback
from radixserve.outputs import GrowingText, RequestOutput, TokenLogprob
from scheduler_helpers import drafts_one_by_one

GREEDY = dict(temperature=0.0, ignore_eos=True)
# Token i decodes to WORDS[i % len(WORDS)]: stop strings and patterns turn up in the text.
WORDS = ["a", "b", "c", " ", "ab", "ST", "OP", "x", "1", "é", "{", "}", "de", "\n", "q", "zz"]


class WordTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(WORDS[i % len(WORDS)] for i in ids)


def shown_text(request: Request) -> str:
    """What a caller was shown of the request's text at a step: the whole text, cut where
    a stop string or pattern could still complete while it runs (the rule before views)."""
    text = request.output_text
    if not request.finished and request.params.stop:
        text = text[: max(0, len(text) - request.params.max_stop_len + 1)]
    if not request.finished and request.params.stop_regex:
        text = text[: stop_regex_holdback(text, request.params.stop_regex)]
    return text


def expected_now(request: Request) -> dict:
    """The cumulative output of the request as of now, copied in full."""
    return dict(
        token_ids=request.output_token_ids, text=shown_text(request),
        logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
        prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
        finished=request.finished,
    )


def check_stream(outputs: list[RequestOutput], expected: list[dict]) -> None:
    """Read every output only now (after later steps ran): each equals the full copy of its
    own step, and the deltas are what each output adds to the one before."""
    sent_tokens, shown = 0, ""
    for i, (out, want) in enumerate(zip(outputs, expected)):
        assert out.completion_tokens == len(want["token_ids"])
        for name, value in want.items():
            assert getattr(out, name) == value, (i, name)
        assert out.delta.first == (i == 0)
        assert out.delta.token_ids == want["token_ids"][sent_tokens:]
        if want["logprobs"] is not None:
            assert out.delta.logprobs == want["logprobs"][sent_tokens:]
        else:
            assert out.delta.logprobs is None
        assert out.delta.text == want["text"][len(shown):]
        sent_tokens = len(want["token_ids"])
        if len(want["text"]) > len(shown):
            shown = want["text"]
    final = outputs[-1]
    assert final.finished
    assert [t for o in outputs for t in o.delta.token_ids] == final.token_ids
    assert "".join(o.delta.text for o in outputs) == final.text


def _logprob(token: int) -> TokenLogprob:
    return TokenLogprob(token, -0.5, [(token, -0.5)])


def _feed(processor: OutputProcessor, request: Request, steps: list[list[int]]):
    """Append each step's tokens (several: a speculative step) with every stop check between
    them; build the step's output and the full copy it used to be."""
    outputs, expected = [], []
    for tokens in steps:
        for token in tokens:
            request.token_ids.append(token)
            if request.params.logprobs is not None:
                request.logprobs.append(_logprob(token))
            reason, stop = processor.add_token(request, token)
            if reason is not None:
                request.status, request.finish_reason, request.stop_reason = RequestStatus.FINISHED, reason, stop
                break
        outputs.append(processor.output(request))
        expected.append(expected_now(request))
        if request.finished:
            break
    return outputs, expected


PARAMS = [
    dict(stop=["STOP", "x1"]),
    dict(stop=["STOP"], include_stop_str_in_output=True, logprobs=1),
    dict(stop_regex=[r"\{[^}]*\}", r"ab+c"]),
    dict(stop_regex=[r"\{[^}]*\}"], stop=["zzq"], include_stop_str_in_output=True, logprobs=0),
    dict(stop=["é\n"], min_tokens=30),
    dict(logprobs=2),
]


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outputs_equal_the_full_copies_of_their_step_and_deltas_add_up(params, seed):
    rng = random.Random(seed)
    request = Request("r", [3, 4, 5], SamplingParams(max_tokens=200, **params), 203)
    processor = OutputProcessor(WordTokenizer(), set())
    processor.register(request)
    steps = [[rng.randrange(64) for _ in range(rng.choice([1, 1, 1, 2, 4]))] for _ in range(200)]
    outputs, expected = _feed(processor, request, steps)
    check_stream(outputs, expected)


class _CountingList(list):
    """A list that counts the elements its slices and iterations copy."""

    copied = 0

    def __getitem__(self, index):
        item = super().__getitem__(index)
        if isinstance(index, slice):
            _CountingList.copied += len(item)
        return item

    def __iter__(self):
        _CountingList.copied += len(self)
        return super().__iter__()


def test_a_step_output_copies_only_what_the_step_added(monkeypatch):
    """No step's output work grows with the answer: per step, the token ids and logprobs
    copied are the step's own, the text read is the step's piece and the held-back tail,
    and the whole text is never joined."""
    read = {"chars": 0, "joined": 0}
    slice_text, value = GrowingText.slice, GrowingText.value

    def counted_slice(self, start, stop=None):
        piece = slice_text(self, start, stop)
        read["chars"] += len(piece)
        return piece

    def counted_value(self):
        read["joined"] += 1
        return value(self)

    monkeypatch.setattr(GrowingText, "slice", counted_slice)
    monkeypatch.setattr(GrowingText, "value", counted_value)
    n = 3000
    params = SamplingParams(max_tokens=n, stop=["never-seen-stop"], logprobs=1)
    request = Request("r", [3, 4, 5], params, 3 + n)
    request.token_ids, request.logprobs = _CountingList(request.token_ids), _CountingList()
    processor = OutputProcessor(WordTokenizer(), set())
    processor.register(request)
    outputs = []
    most_chars = 0
    for i in range(n):
        token = 2 + i % 13  # never a stop
        request.token_ids.append(token)
        request.logprobs.append(_logprob(token))
        _CountingList.copied, read["chars"] = 0, 0
        processor.add_token(request, token)
        outputs.append(processor.output(request))
        assert _CountingList.copied == 2, f"step {i} copied {_CountingList.copied} ids and logprobs"
        most_chars = max(most_chars, read["chars"])
    longest_word = max(len(w) for w in WORDS)
    assert most_chars <= 2 * (longest_word + params.max_stop_len)
    assert read["joined"] == 0
    # the cumulative fields are built when read: the 1000th output still shows its own step
    first = request.output_token_ids[:1000]
    assert outputs[999].token_ids == first and outputs[999].logprobs == [_logprob(t) for t in first]
    assert outputs[999].text == WordTokenizer().decode(first)[: -(params.max_stop_len - 1)]


def test_growing_text_reads_spans_and_keeps_snapshots():
    text = GrowingText()
    whole = ""
    rng = random.Random(3)
    for _ in range(300):
        piece = "".join(rng.choice("abcé ") for _ in range(rng.randrange(0, 5)))
        text.append(piece)
        whole += piece
        assert len(text) == len(whole)
    for _ in range(200):
        a = rng.randrange(len(whole) + 1)
        b = rng.randrange(a, len(whole) + 3)
        assert text.slice(a, b) == whole[a:b]
    assert text.slice(5) == whole[5:] and text.value() == whole
    snap = text.snapshot(len(whole) - 3)
    text.truncate(10)
    text.append("tail")
    assert text.value() == whole[:10] + "tail" and snap.build() == whole[:-3]
    text.set("new")
    assert text.value() == "new" and text.slice(1) == "ew" and len(text) == 3


def test_request_output_keeps_its_dataclass_api():
    a = RequestOutput("r", None, [1, 2], [5, 6], "hi", True, "stop", cached_tokens=1)
    b = RequestOutput("r", None, [1, 2], [5, 6], "hi", True, "stop", cached_tokens=1)
    assert a == b and a.completion_tokens == 2 and a.prompt_tokens == 2 and a.metrics == {} and a.delta is None
    b.text = "ho"
    assert a != b and "text='ho'" in repr(b)
    with pytest.raises(TypeError):
        hash(a)


# ---- through the engine ----------------------------------------------------------------------


class _Oracle(PromptLookupDrafter):
    """Drafts the reference continuation (one token in three wrong): steps of several tokens."""

    def __init__(self, references: dict[tuple, list[int]]):
        super().__init__(8, 1, 3, default_on=True)
        self.references = references

    def propose_step(self, asks, decodes, budget):
        return drafts_one_by_one(self, asks, budget)

    def propose(self, request, max_tokens):
        if max_tokens <= 0 or not self.eligible(request):
            return []
        done = request.num_output_tokens
        draft = list(self.references[tuple(request.prompt_token_ids)][done:done + 4])
        if draft and done % 3 == 1:
            draft[-1] = (draft[-1] + 1) % 97
        return draft[:max_tokens]


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]):
    engine.outputs.tokenizer = WordTokenizer()  # text for the tiny model's ids
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    held = {rid: engine._requests[rid] for rid in ids}  # noqa: SLF001: the oracle reads the request
    streams: dict[str, tuple[list, list]] = {rid: ([], []) for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs, expected = streams[out.request_id]
            outputs.append(out)
            expected.append(expected_now(held[out.request_id]))
    for rid in ids:
        check_stream(*streams[rid])
    engine.check_integrity()
    return {rid: streams[rid][0] for rid in ids}


def test_engine_outputs_with_logprobs_stops_samples_and_preemption(tiny_model_dir):
    directory = tiny_model_dir("llama")
    engine = Engine(str(directory), block_size=4, num_kv_blocks=14, chunked_prefill_size=8,
                    max_num_batched_tokens=32)
    shared = [7, 8, 9, 10, 11, 12, 13]
    requests = [(shared, SamplingParams(max_tokens=20, temperature=1.0, seed=s, stop=["OPOP", "}é}", "zz"],
                                        logprobs=2)) for s in range(3)]  # n=3 samples of one prompt
    requests += [
        ([20, 21, 22, 23, 24, 25, 26, 27, 28], SamplingParams(max_tokens=24, stop_regex=[r"z+\}"], **GREEDY)),
        ([30, 31, 32, 33, 34], SamplingParams(max_tokens=24, prompt_logprobs=1, logprobs=0, **GREEDY)),
        ([40, 41, 42], SamplingParams(max_tokens=24, stop=["{zz"], include_stop_str_in_output=True, **GREEDY)),
    ]
    streams = _run(engine, requests)
    assert engine.stats()["preemptions"] > 0
    assert sum(stream[-1].finish_reason == "stop" for stream in streams.values()) >= 4  # the stops are met


def test_engine_speculative_steps_hand_out_each_steps_tokens_once(tiny_model_dir):
    directory = tiny_model_dir("llama")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]
    plain = Engine(str(directory), block_size=4, num_kv_blocks=256)
    references = {tuple(p): o.token_ids for p, o in
                  zip(prompts, plain.generate(prompts, SamplingParams(max_tokens=30, **GREEDY)))}
    engine = Engine(str(directory), block_size=4, num_kv_blocks=256, speculative="prompt-lookup",
                    speculative_max_batch=64)
    engine.drafter = engine.scheduler.drafter = _Oracle(references)
    # the first stops on a stop string its accepted drafts run past
    stop = WordTokenizer().decode(references[tuple(prompts[0])][10:12])
    streams = _run(engine, [(prompts[0], SamplingParams(max_tokens=30, stop=[stop], **GREEDY)),
                            (prompts[1], SamplingParams(max_tokens=30, **GREEDY))])
    assert engine.stats()["spec_accepted_tokens"] > 0
    assert any(len(o.delta.token_ids) > 1 for stream in streams.values() for o in stream)
    second = list(streams.values())[1]
    assert second[-1].token_ids == references[tuple(prompts[1])]
    first = list(streams.values())[0]
    assert first[-1].stop_reason == stop and len(first[-1].token_ids) <= 12
