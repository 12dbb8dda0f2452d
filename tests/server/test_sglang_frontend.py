"""Real SGLang programs (`import sglang as sgl`, `@sgl.function`, `sgl.RuntimeEndpoint`)
against a live radixserve server on loopback: every result is checked against the
in-process engine's own greedy output or log-probabilities, computed before the server
starts; the server's integrity check runs after each test."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from radixserve import SamplingParams
from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer

sgl = pytest.importorskip("sglang")  # the `sglang` extra (scripts/setup.sh installs it)
from sglang.lang.choices import (  # noqa: E402
    greedy_token_selection, token_length_normalized, unconditional_likelihood_normalized,
)
from sglang.lang.ir import REGEX_INT  # noqa: E402

pytestmark = pytest.mark.real_model

GREEDY = dict(temperature=0.0)
COUNT = "Count with me: one, two, three,"
ARITH = "Question: What is 12 plus 30?\nAnswer (a number): "
PICK = "The sky on a clear summer day is the colour"
COLOURS = [" blue", " green", " red", " yellow"]
STORY = "Once upon a time, in a quiet harbour town, there lived"
FORK = "Here is a list of fruits that grow on trees in warm countries around the world: mango, papaya,"
FEWSHOT = (
    "Classify the sentiment of each review as positive or negative.\n\n"
    "Review: The food was wonderful and the staff were kind.\nSentiment: positive\n\n"
    "Review: I waited an hour and the soup was cold.\nSentiment: negative\n\n"
    "Review: Best concert I have been to in years.\nSentiment: positive\n\n"
    "Review: The hotel room smelled of smoke and the bed was broken.\nSentiment: negative\n\n"
)
REVIEWS = ["A delightful film with a moving ending.", "The phone broke after two days.",
           "Friendly people and a beautiful view.", "Terrible service, never again."]


class Expected:
    """The engine's own answers, computed in process before the server takes the engine."""

    def __init__(self, engine):
        self.engine = engine
        greedy = lambda n, **kw: SamplingParams(max_tokens=n, **GREEDY, **kw)  # noqa: E731
        prompt_len = len(engine.tokenizer.encode(PICK))
        self.choice_start = max(prompt_len - 2, 0)
        jobs = {  # one batch: the engine runs them together
            "count": (COUNT, greedy(12, stop=[","])),
            "count_free": (COUNT, greedy(12)),
            "number": (ARITH, greedy(6, regex=REGEX_INT, stop=[" ", "\n"])),
            "story": (STORY, greedy(10, logprobs=2)),
            **{f"fork{i}": (FORK + s, greedy(6)) for i, s in enumerate((" banana,", " lime,"))},
            **{f"review{i}": (FEWSHOT + f"Review: {r}\nSentiment:", greedy(2, stop=["\n"])) for i, r in enumerate(REVIEWS)},
            **{f"choice{i}": (PICK + c, SamplingParams(max_tokens=0, prompt_logprobs=0,
                                                       prompt_logprobs_start=self.choice_start))
               for i, c in enumerate(COLOURS)},
        }
        outs = dict(zip(jobs, engine.generate([p for p, _ in jobs.values()], [sp for _, sp in jobs.values()])))
        self.count = outs["count"].text
        self.count_free = outs["count_free"].text
        self.count2 = engine.generate([COUNT + self.count + ","], greedy(3))[0].text
        self.number = outs["number"].text
        self.story = outs["story"]
        self.forks = [outs["fork0"].text, outs["fork1"].text]
        self.reviews = [outs[f"review{i}"].text for i in range(len(REVIEWS))]
        self.fewshot_tokens = len(engine.tokenizer.encode(FEWSHOT))
        self.choice_entries = _shared_prefix_alike([self._choice_entries(outs[f"choice{i}"]) for i in range(len(COLOURS))])
        alone = engine.generate([[e[1] for e in lst] for lst in self.choice_entries],
                                SamplingParams(max_tokens=0, prompt_logprobs=0))
        self.unconditional = [[[lp.logprob if lp else None, t] for lp, t in zip(o.prompt_logprobs, o.prompt_token_ids)]
                              for o in alone]

    def _choice_entries(self, out) -> list[list]:
        """SGLang's select input (input_token_logprobs from prompt_len - 2 on, the token
        healing entry dropped as its RuntimeEndpoint does), from the engine's prompt logprobs."""
        start = self.choice_start
        entries = [[lp.logprob, t, self.engine.tokenizer.decode([t])]
                   for lp, t in zip(out.prompt_logprobs[start:], out.prompt_token_ids[start:])]
        return entries[1:] if PICK.endswith(entries[0][2]) else entries


def _shared_prefix_alike(entries: list[list]) -> list[list]:
    """The choices' entries with the tokens all of them share given the first choice's logprob.
    The four prompts ran as rows of one batch, and on some CPUs (AVX2 without AVX-512) the
    BLAS's result for a row depends on its place in the batch in the last bits; the server
    computes the shared prefix once (the radix cache), so its entries tie exactly there, and
    SGLang's greedy selection breaks ties on the first token that differs, as it must."""
    shared = 0
    while all(len(e) > shared for e in entries) and len({e[shared][1] for e in entries}) == 1:
        shared += 1
    return [[[entries[0][j][0], *entry[1:]] if j < shared else entry for j, entry in enumerate(lst)]
            for lst in entries]


@pytest.fixture(scope="module")
def served(served_engine):
    expected = Expected(served_engine)
    served_engine.flush_cache()
    app = create_app(served_engine, ServerOptions(enable_debug_endpoints=True))
    with BackgroundServer(app) as server:
        server.backend = sgl.RuntimeEndpoint(server.url)
        server.expected = expected
        yield server
    served_engine.check_integrity()
    assert not served_engine.has_unfinished_requests()
    served_engine.flush_cache()


@pytest.fixture(autouse=True)
def integrity(served):
    yield
    check = httpx.post(served.url + "/debug/check_integrity", timeout=60)
    assert check.status_code == 200 and check.json()["ok"], check.text


def run(served, program, **kwargs):
    state = program.run(backend=served.backend, temperature=0, **kwargs)
    assert state.error() is None
    return state


# ---- gen ---------------------------------------------------------------------------------


@sgl.function
def counting(s):
    s += COUNT + sgl.gen("a", max_tokens=12, stop=",") + ","
    s += sgl.gen("b", max_tokens=3)


def test_gen_with_stop_and_max_tokens(served):
    state = run(served, counting)
    assert state["a"] == served.expected.count
    assert state["b"] == served.expected.count2
    meta_a, meta_b = state.get_meta_info("a"), state.get_meta_info("b")
    assert meta_a["finish_reason"]["type"] == "stop" and meta_a["finish_reason"]["matched"] == ","
    assert meta_b["finish_reason"] == {"type": "length", "length": 3} and meta_b["completion_tokens"] == 3


@sgl.function
def arithmetic(s):
    s += ARITH + sgl.gen("n", max_tokens=6, dtype=int)


def test_gen_dtype_int(served):
    state = run(served, arithmetic)
    assert state["n"] == served.expected.number
    int(state["n"])  # an integer, as dtype=int's regex and stops make it


@sgl.function
def address(s):
    s += "The server's address is 10.0." + sgl.gen("ip", max_tokens=10, regex=r"[0-9]{1,3}\.[0-9]{1,3}")


def test_gen_regex(served):
    import re

    ip = run(served, address)["ip"]
    assert re.fullmatch(r"[0-9]{1,3}\.[0-9]{1,3}", ip), ip


@sgl.function
def stop_at_regex(s):
    s += COUNT + sgl.gen("a", max_tokens=12, stop_regex=STOP_REGEX)


STOP_REGEX = r"f\w+, f\w+"  # spans several tokens


def test_gen_stop_regex(served):
    import re

    state = run(served, stop_at_regex)
    full = served.expected.count_free
    match = re.search(STOP_REGEX, full)
    assert match is not None, full
    assert state["a"] == full[: match.start()]
    reason = state.get_meta_info("a")["finish_reason"]
    assert reason["type"] == "stop" and re.fullmatch(STOP_REGEX, reason["matched"])


# ---- select ----------------------------------------------------------------------------


@sgl.function
def sky(s, method):
    s += PICK + sgl.select("colour", choices=COLOURS, choices_method=method)


@pytest.mark.parametrize(
    "method", [token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized],
    ids=["normalized", "greedy", "unconditional"],
)
def test_select_picks_the_argmax_of_the_engine_logprobs(served, method):
    state = run(served, sky, method=method)
    entries = served.expected.choice_entries
    normalized = [sum(e[0] for e in lst) / len(lst) for lst in entries]
    want = method(choices=COLOURS, normalized_prompt_logprobs=normalized, input_token_logprobs=entries,
                  output_token_logprobs=[[] for _ in COLOURS],
                  unconditional_token_logprobs=served.expected.unconditional)
    assert state["colour"] == want.decision
    got = state.get_meta_info("colour")["input_token_logprobs"]
    for got_list, want_list in zip(got, entries):
        assert [e[1] for e in got_list] == [e[1] for e in want_list]
        assert [e[0] for e in got_list] == pytest.approx([e[0] for e in want_list], abs=2e-3)
    if method is unconditional_likelihood_normalized:
        got = state.get_meta_info("colour")["unconditional_token_logprobs"]
        for got_list, want_list in zip(got, served.expected.unconditional):
            assert [e[1] for e in got_list] == [e[1] for e in want_list] and got_list[0][0] is None
            assert [e[0] for e in got_list[1:]] == pytest.approx([e[0] for e in want_list[1:]], abs=2e-3)


# ---- fork / join, streaming, logprobs ------------------------------------------------------


@sgl.function
def fruits(s):
    s += FORK
    forks = s.fork(2)
    for f, extra in zip(forks, (" banana,", " lime,")):
        f += extra + sgl.gen("more", max_tokens=6)
    forks.join()


def test_fork_join_share_the_prefix(served):
    before = httpx.get(served.url + "/debug/stats").json()
    state = run(served, fruits)
    assert state["more"] == served.expected.forks
    after = httpx.get(served.url + "/debug/stats").json()
    # The branches run concurrently: one computes the prefix's full block, the other reuses it.
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] >= 16
    assert after["computed_tokens"] - before["computed_tokens"] < after["prompt_tokens"] - before["prompt_tokens"]


@sgl.function
def story(s):
    s += STORY + sgl.gen("tale", max_tokens=10)


def test_streaming_gives_the_same_text(served):
    state = story.run(backend=served.backend, temperature=0, stream=True)
    pieces = list(state.text_iter("tale"))
    assert len(pieces) > 1
    assert "".join(pieces) == served.expected.story.text == state["tale"]


@sgl.function
def scored_story(s):
    s += STORY + sgl.gen("tale", max_tokens=4, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True)


def test_return_logprob(served):
    state = run(served, scored_story)
    want = served.expected.story  # the first 4 of its 10 greedy tokens
    meta = state.get_meta_info("tale")
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == want.token_ids[:4]
    assert [e[0] for e in entries] == pytest.approx([lp.logprob for lp in want.logprobs[:4]], abs=2e-3)
    assert "".join(e[2] for e in entries) == state["tale"]
    tops = [[t[1] for t in top] for top in meta["output_top_logprobs"]]
    assert tops == [[t for t, _ in lp.top] for lp in want.logprobs[:4]]
    assert meta["input_token_logprobs"] == []  # SGLang's default logprob_start_len: no prompt positions here


# ---- run_batch over a shared few-shot prefix -------------------------------------------------


@sgl.function
def sentiment(s, review):
    s += FEWSHOT + f"Review: {review}\nSentiment:" + sgl.gen("label", max_tokens=2, stop="\n")


def test_run_batch_reuses_the_cached_fewshot_prefix(served):
    served.backend.cache_prefix(FEWSHOT)  # max_new_tokens 0: prefill only
    states = sentiment.run_batch([{"review": r} for r in REVIEWS], backend=served.backend, temperature=0,
                                 num_threads=4)
    assert [s["label"] for s in states] == served.expected.reviews
    full_blocks = 16 * (served.expected.fewshot_tokens // 16)
    cached = [s.get_meta_info("label")["cached_tokens"] for s in states]
    prompts = [s.get_meta_info("label")["prompt_tokens"] for s in states]
    assert all(c >= full_blocks - 16 for c in cached), (cached, full_blocks)
    assert sum(cached) / sum(prompts) > 0.6


# ---- SGLang's other endpoints ------------------------------------------------------------------


def test_model_info_server_info_and_flush_cache(served):
    info = httpx.get(served.url + "/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] == info["tokenizer_path"]
    server = httpx.get(served.url + "/get_server_info").json()
    assert server["engine"]["block_size"] == server["block_size"] and server["version"]
    assert httpx.get(served.url + "/flush_cache").status_code == 200
    assert httpx.post(served.url + "/flush_cache", content=b"{}").json()["freed_blocks"] == 0
    served.backend.flush_cache()  # RuntimeEndpoint: POST without a body
    bad = httpx.post(served.url + "/flush_cache", content=b"{\"all\": 1}")
    assert bad.status_code == 400 and "all" in bad.json()["error"]["message"]


def test_abort_request_by_rid_ends_the_generate_call(served):
    body = {"text": STORY, "rid": "long-one", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    answer = {}
    caller = threading.Thread(target=lambda: answer.update(httpx.post(served.url + "/generate", json=body,
                                                                        timeout=120).json()))
    caller.start()
    deadline = time.monotonic() + 60
    aborted = 0
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.2)
        aborted = httpx.post(served.url + "/abort_request", json={"rid": "long-one"}).json()["aborted"]
    caller.join(60)
    assert aborted == 1 and not caller.is_alive()
    assert answer["meta_info"]["id"] == "long-one" and answer["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(answer["output_ids"]) < 400
    assert httpx.post(served.url + "/abort_request", json={"rid": "long-one"}).json() == {"aborted": 0}
    assert httpx.post(served.url + "/abort_request", json={}).status_code == 400


@pytest.mark.parametrize("body, message, param", [
    ({"sampling_params": {"max_tokens": 2, "max_new_tokens": 2}}, "give one of 'max_tokens' and 'max_new_tokens'",
     "sampling_params.max_new_tokens"),
    ({"sampling_params": {"max_new_tokens": -1}}, "'sampling_params.max_new_tokens' must be >= 0", None),
    ({"sampling_params": {"stop_regex": "(a"}}, "stop_regex '(a' is not a valid regular expression", None),
    ({"sampling_params": {"stop_regex": "a*"}}, "matches the empty string", None),
    ({"sampling_params": {"n": 0}}, "'sampling_params.n' must be >= 1", None),
    ({"rid": ["a", "b"]}, "'rid' must give one id per prompt (1), got 2", "rid"),
    ({"return_logprob": True, "sampling_params": {"logprobs": 1}}, "either as 'return_logprob'", "return_logprob"),
    ({"logprob_start_len": -2}, "'logprob_start_len' must be >= -1", None),
    ({"top_logprobs_num": 21}, "'top_logprobs_num' must be <= 20", None),
    ({"token_ids_logprob": [1, 2]}, "unknown field(s): token_ids_logprob", None),
])
def test_bad_sglang_fields_are_a_clear_400(served, body, message, param):
    response = httpx.post(served.url + "/generate", json={"text": "Hello", **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"], error
    if param is not None:
        assert error["param"] == param


def test_n_rids_and_a_prefill_only_batch(served):
    body = {"text": [STORY, COUNT], "rid": ["s", "c"], "sampling_params": {"max_new_tokens": 3, "n": 2, "temperature": 0}}
    answers = httpx.post(served.url + "/generate", json=body, timeout=120).json()
    assert [a["meta_info"]["id"] for a in answers] == ["s", "s", "c", "c"]
    assert answers[0]["output_ids"] == answers[1]["output_ids"] == served.expected.story.token_ids[:3]
    warm = {"text": [STORY, COUNT], "sampling_params": {"max_new_tokens": 0}, "stream": True}
    with httpx.stream("POST", served.url + "/generate", json=warm, timeout=120) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 3
    import json

    finals = sorted((json.loads(e) for e in events[:-1]), key=lambda e: e["index"])
    assert [f["output_ids"] for f in finals] == [[], []]
    assert [f["meta_info"]["finish_reason"] for f in finals] == [{"type": "length", "length": 0}] * 2


def test_abort_request_ends_a_stream_with_an_abort_answer(served):
    import json

    body = {"text": STORY, "rid": "streamed", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    events = []
    with httpx.stream("POST", served.url + "/generate", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if len(events) == 3:
                assert httpx.post(served.url + "/abort_request", json={"rid": "streamed"}).json() == {"aborted": 1}
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["id"] == "streamed" and last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 3 <= len(last["output_ids"]) < 400
