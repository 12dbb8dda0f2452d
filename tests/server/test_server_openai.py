"""The server through the official openai client (and httpx for /generate, /metrics):
greedy text equals the in-process engine's, streaming and not, n > 1, logprobs, usage."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve import SamplingParams
from radixserve.engine.cpu_share import usable_cores
from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8
PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]
CHAT = "What is 17 * 3?"
# Long enough for two full KV blocks of 16 tokens, so repeats hit the prefix cache.
LONG_PROMPT = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who repaired every clock in the valley. One winter morning a stranger arrived and said"
)


@dataclass
class Served:
    url: str
    app: Any
    engine: Any
    expected: dict[str, Any]  # prompt -> the engine's greedy RequestOutput (logprobs=2)
    chat_expected: Any

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def engine_call(self, fn):
        return self.app.state.server.engine.run_on_engine(fn).result(timeout=60)


@pytest.fixture(scope="module")
def served(served_engine):
    engine = served_engine
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)
    expected = {p: engine.generate([p], greedy)[0] for p in PROMPTS + [LONG_PROMPT]}
    chat_ids = engine.apply_chat_template([{"role": "user", "content": CHAT}])
    chat_expected = engine.generate([chat_ids], greedy)[0]
    engine.flush_cache()
    app = create_app(engine, ServerOptions(enable_debug_endpoints=True))
    with BackgroundServer(app) as server:
        yield Served(server.url, app, engine, expected, chat_expected)
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    engine.flush_cache()


def test_models_lists_the_served_model(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_equals_engine_greedy(served):
    prompt = PROMPTS[0]
    out = served.client().completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    want = served.expected[prompt]
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == want.finish_reason
    assert out.usage.prompt_tokens == want.prompt_tokens
    assert out.usage.completion_tokens == want.completion_tokens
    assert out.usage.total_tokens == want.prompt_tokens + want.completion_tokens
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    assert out.model == MODEL and out.object == "text_completion"


def test_completion_stream_equals_engine_greedy(served):
    prompt = PROMPTS[1]
    stream = served.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    want = served.expected[prompt]
    assert text == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.completion_tokens
    assert all(c.usage is None and "usage" in c.model_fields_set for c in chunks[:-1])  # null, as OpenAI sends


def test_completion_prompt_forms(served):
    client = served.client()
    ids = [served.expected[p].prompt_token_ids for p in PROMPTS]
    wants = [served.expected[p].text for p in PROMPTS]
    for prompt in (PROMPTS, ids):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert [c.index for c in out.choices] == [0, 1]
        assert [c.text for c in out.choices] == wants
        assert out.usage.prompt_tokens == sum(len(i) for i in ids)
    out = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == wants[0]


def test_completion_echo_and_legacy_logprobs(served):
    prompt = PROMPTS[0]
    want = served.expected[prompt]
    out = served.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, echo=True, logprobs=2
    )
    choice = out.choices[0]
    assert choice.text == prompt + want.text
    lp = choice.logprobs
    n_prompt, n_out = want.prompt_tokens, want.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + n_out
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == choice.text
    completion_lps = lp.token_logprobs[n_prompt:]
    assert completion_lps == pytest.approx([e.logprob for e in want.logprobs], abs=1e-3)
    for top, entry in zip(lp.top_logprobs[n_prompt:], want.logprobs):
        assert 2 <= len(top) <= 3  # the top 2, plus the chosen token when it is not among them


def test_completion_logprobs_stream_without_echo(served):
    prompt = PROMPTS[0]
    want = served.expected[prompt]
    chunks = list(served.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0, stream=True
    ))
    lps = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert lps == pytest.approx([e.logprob for e in want.logprobs], abs=1e-3)
    offsets = [x for c in chunks for x in c.choices[0].logprobs.text_offset]
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_n_greedy_samples_share_the_prompt_blocks(served):
    before = served.engine_call(lambda e: e.stats())
    out = served.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=MAX_TOKENS, temperature=0, n=3)
    after = served.engine_call(lambda e: e.stats())
    want = served.expected[LONG_PROMPT]
    assert [c.text for c in out.choices] == [want.text] * 3
    assert out.usage.completion_tokens == 3 * want.completion_tokens
    assert out.usage.prompt_tokens == want.prompt_tokens
    full_blocks = want.prompt_tokens // 16 * 16
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] >= 2 * full_blocks


def test_n_seeded_samples_use_seed_plus_index(served):
    client = served.client()
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=1.0)
    together = client.completions.create(n=3, seed=11, **kwargs)
    alone = [client.completions.create(n=1, seed=11 + i, **kwargs).choices[0].text for i in range(3)]
    assert [c.text for c in together.choices] == alone
    assert len(set(alone)) > 1


def test_chat_equals_engine_greedy(served):
    client = served.client()
    want = served.chat_expected
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": CHAT}], max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.choices[0].message.content == want.text
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == want.finish_reason
    assert out.usage.prompt_tokens == want.prompt_tokens
    parts = [{"type": "text", "text": CHAT[:5]}, {"type": "text", "text": CHAT[5:]}]
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_completion_tokens=MAX_TOKENS, temperature=0
    )
    assert again.choices[0].message.content == want.text
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_stream_n2_equals_engine_greedy(served):
    want = served.chat_expected
    chunks = list(served.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": CHAT}], max_tokens=MAX_TOKENS, temperature=0,
        n=2, stream=True, stream_options={"include_usage": True},
    ))
    texts = {0: "", 1: ""}
    roles = set()
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
    assert texts == {0: want.text, 1: want.text}
    assert roles == {0, 1}
    assert chunks[-1].usage.completion_tokens == 2 * want.completion_tokens
    assert all(c.usage is None and "usage" in c.model_fields_set for c in chunks[:-1])  # null, as OpenAI sends


def test_chat_logprobs(served):
    want = served.chat_expected
    out = served.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": CHAT}], max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-3)
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", errors="replace") == want.text
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_stop_string_cuts_the_text(served):
    want = served.expected[PROMPTS[0]].text
    stop = want.strip()[2:5]
    out = served.client().completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=[stop, "zzz"]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == want[: want.index(stop)]


def test_sampling_options_are_accepted(served):
    out = served.client().chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=4, temperature=0.7, top_p=0.9, frequency_penalty=0.5, presence_penalty=0.5, seed=3,
        user="someone", stop="\n\n", response_format={"type": "text"},
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    assert 1 <= out.usage.completion_tokens <= 4


def test_chat_response_format_json_schema_validates(served):
    import jsonschema

    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 1000}},
              "required": ["answer"], "additionalProperties": False}
    out = served.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": CHAT}], max_tokens=32, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    grammar_bytes = [s.value for f in text_string_to_metric_families(httpx.get(served.url + "/metrics").text)
                     for s in f.samples if s.name == "radixserve_grammar_cache_bytes"]
    assert len(grammar_bytes) == 1 and grammar_bytes[0] > 0  # the compiled schema is held, and /metrics says so
    anything = served.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": CHAT}], max_tokens=32, temperature=0.8, seed=3,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_a_real_client_gets_vllm_guided_choice_and_a_400_for_a_misspelt_field(served):
    client = served.client()
    messages = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.9, seed=1,
                                         extra_body={"guided_choice": ["definitely", "never"]})
    assert out.choices[0].message.content in ("definitely", "never")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={"temprature": 0})
    assert refused.value.body["param"] == "temprature" and "unknown field" in refused.value.body["message"]


def test_generate_native_regex(served):
    import re

    body = {"text": "My phone number is", "sampling_params": {"max_tokens": 20, "temperature": 0.0,
                                                               "regex": r"\d{3}-\d{4}"}}
    out = httpx.post(served.url + "/generate", json=body, timeout=120).json()
    assert re.fullmatch(r"\d{3}-\d{4}", out["text"])


def test_generate_native(served):
    prompt = PROMPTS[0]
    want = served.expected[prompt]
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0}
    body = httpx.post(served.url + "/generate", json={"text": prompt, "sampling_params": greedy}, timeout=60).json()
    assert body["text"] == want.text and body["output_ids"] == want.token_ids
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == want.prompt_tokens and meta["completion_tokens"] == want.completion_tokens
    assert meta["finish_reason"]["type"] == want.finish_reason and meta["cached_tokens"] >= 0
    assert 0 < meta["ttft_s"] <= meta["e2e_latency"]
    batch = httpx.post(
        served.url + "/generate", json={"input_ids": [want.prompt_token_ids] * 2, "sampling_params": greedy}, timeout=60
    ).json()
    assert [b["text"] for b in batch] == [want.text] * 2


def test_generate_native_stream(served):
    prompt = PROMPTS[1]
    want = served.expected[prompt]
    events = []
    body = {"text": prompt, "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0}, "stream": True}
    with httpx.stream("POST", served.url + "/generate", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    results = [json.loads(e) for e in events[:-1]]
    assert results[-1]["text"] == want.text and results[-1]["meta_info"]["finish_reason"]["type"] == want.finish_reason
    assert [len(r["output_ids"]) for r in results] == list(range(1, want.completion_tokens + 1))


def test_metrics_parse_and_move(served):
    def scrape() -> dict[str, float]:
        text = httpx.get(served.url + "/metrics").text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items()))
                values[key] = sample.value
        return values

    served.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=1, temperature=0)  # cached now
    before = scrape()
    served.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, temperature=0)
    after = scrape()
    completions_ok = "radixserve_http_requests_total,endpoint=/v1/completions,status=200"
    assert after[completions_ok] == before.get(completions_ok, 0) + 1
    assert after["radixserve_prompt_tokens_total"] > before["radixserve_prompt_tokens_total"]
    assert after["radixserve_cached_prompt_tokens_total"] > before["radixserve_cached_prompt_tokens_total"]
    assert after["radixserve_generated_tokens_total"] >= before["radixserve_generated_tokens_total"] + 4
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert after[f"radixserve_{name}_count"] == before[f"radixserve_{name}_count"] + 1
    assert after["radixserve_kv_blocks_total"] == after["radixserve_kv_blocks_free"] + after["radixserve_kv_blocks_used"]
    assert after["radixserve_kv_blocks_cached"] > 0
    assert after["radixserve_requests_running"] == 0 and after["radixserve_requests_waiting"] == 0
    assert "radixserve_preemptions_total" in after
    # the cores steps use (engine/cpu_share.py): at least one thread, never more than the usable cores
    assert after["radixserve_cpu_usable_cores"] == usable_cores()
    assert 1 <= after["radixserve_cpu_threads"] <= after["radixserve_cpu_usable_cores"]
    assert after["radixserve_cpu_others_cores"] >= 0 and "radixserve_cpu_team_reductions_total" in after


COPY_PROMPT = "Copy this line twice: red apple, blue river, green stone, gold ring.\n" * 2 + "red apple, blue"


def test_per_request_speculative_keeps_the_output_and_drafts(served, monkeypatch):
    """`speculative` (an extension field, off by the server's default here) turns on
    prompt-lookup drafting for one request: same greedy text, and drafts were verified.
    Draft lengths by the acceptance rule alone: whether a measured step table says drafts pay
    on this machine is not what is checked here (tests/core/test_draft_length.py is)."""
    monkeypatch.setattr(served.engine.drafter, "adaptive", False)

    def stats() -> dict:
        return httpx.get(served.url + "/debug/stats").json()

    client = served.client()
    kwargs = dict(model=MODEL, prompt=COPY_PROMPT, max_tokens=24, temperature=0)
    before = stats()
    plain = client.completions.create(**kwargs, extra_body={"speculative": False})
    assert stats()["spec_drafts"] == before["spec_drafts"]
    drafted = client.completions.create(**kwargs, extra_body={"speculative": True})
    assert drafted.choices[0].text == plain.choices[0].text
    after = stats()
    assert after["spec_drafts"] > before["spec_drafts"] and after["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": COPY_PROMPT}],
                                          max_tokens=16, temperature=0, extra_body={"speculative": True})
    chat_plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": COPY_PROMPT}],
                                                max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == chat_plain.choices[0].message.content
    native = httpx.post(served.url + "/generate", json={
        "text": COPY_PROMPT, "sampling_params": {"max_tokens": 24, "temperature": 0, "speculative": True}}).json()
    assert native["text"] == plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs, extra_body={"speculative": "sometimes"})
    assert "speculative" in str(info.value)


def test_flush_cache(served):
    served.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    freed = httpx.post(served.url + "/flush_cache").json()["freed_blocks"]
    assert freed > 0
    stats = httpx.get(served.url + "/debug/stats").json()
    assert stats["blocks_cached"] == 0 and stats["blocks_free"] == stats["blocks_total"]


def test_engine_thread_sleeps_when_idle(served):
    served.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0)
    from radixserve.kernels import heap

    engine = served.app.state.server.engine
    if heap._libc("malloc_trim") is not None:  # the idle heap trim, IDLE_TRIM_S after the work: not measured
        trims, deadline = engine._engine_loop.heap_trims, time.monotonic() + 10
        while engine._engine_loop.heap_trims == trims and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine._engine_loop.heap_trims == trims + 1
    thread_id = engine.native_thread_id
    before = _cpu_ticks(thread_id)
    time.sleep(1.0)
    assert _cpu_ticks(thread_id) - before <= 2  # clock ticks (1/100 s): no busy waiting


def _cpu_ticks(thread_id: int) -> int:
    """User + system CPU time of one thread of this process, in clock ticks."""
    with open(f"/proc/self/task/{thread_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])
