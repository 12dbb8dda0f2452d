"""radixserve.lang on the real model through rl.Runtime: constrained gens always match,
select agrees with transformers, forks and batches compute their shared prefix once."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

import radixserve.lang as rl

pytestmark = pytest.mark.real_model

BLOCK = 16
REGEX = r"(yes|no), [0-9]{1,3}-[A-Z]{2}"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
# About 90 tokens: several full KV blocks that forks and batches share.
SHARED_SYSTEM = (
    "You are the front desk of a small bicycle repair shop. The shop is open from nine to five "
    "on weekdays and from ten to two on Saturdays. Repairs take one to three days. A basic tune-up "
    "costs forty dollars, a new chain costs twenty-five dollars, and flat tires are fixed while "
    "the customer waits. Answer every question in one short sentence."
)


@pytest.fixture(scope="module")
def runtime(real_engine):
    backend = rl.Runtime(engine=real_engine)
    yield backend
    backend.shutdown()
    real_engine.check_integrity()


@rl.function
def code_for(s, item):
    s += rl.user(f"Give the code for item {item}.")
    s += rl.assistant(rl.gen("code", regex=REGEX, max_tokens=16))


@rl.function
def person(s, number):
    s += rl.user(f"Describe person number {number} as JSON.")
    s += rl.assistant(rl.gen("person", json_schema=SCHEMA, max_tokens=64))  # room for a 12-character name spelt byte by byte


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_regex_gens_always_match(runtime, temperature):
    states = code_for.run_batch(
        [{"item": i} for i in range(8)], backend=runtime, temperature=temperature, seed=None if temperature == 0 else 7
    )
    for state in states:
        assert re.fullmatch(REGEX, state["code"]), state["code"]
        assert state.get_meta_info("code")["finish_reason"] == "stop"


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_json_schema_gens_always_validate(runtime, temperature):
    states = person.run_batch(
        [{"number": i} for i in range(8)], backend=runtime, temperature=temperature, seed=None if temperature == 0 else 7
    )
    for state in states:
        assert state.get_meta_info("person")["finish_reason"] == "stop", state["person"]  # not cut by max_tokens
        jsonschema.validate(json.loads(state["person"]), SCHEMA)


def test_a_bad_regex_raises_with_the_reason(runtime):
    state = rl.ProgramState(runtime)
    state += "Code: " + rl.gen("code", regex="([a-z", max_tokens=4)
    with pytest.raises(ValueError, match="invalid regex"):
        state.sync()


CHOICES = ["Yes", "No", "It depends on the weather", "blue"]


@rl.function
def sky(s, choices_method="total"):
    s += rl.system("Answer the question.")
    s += rl.user("Is the sky blue on a clear day?")
    s += rl.assistant(rl.select("answer", choices=CHOICES, choices_method=choices_method))


def test_select_picks_the_highest_total_logprob_as_transformers_computes_it(runtime, hf_real_model):
    state = sky.run(backend=runtime)
    scores = state.scores("answer")
    prefix = state.text()[: state.text().rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")]
    expected = [_hf_choice_logprob(hf_real_model, runtime.encode, prefix, c) for c in CHOICES]
    assert scores.total_logprobs == pytest.approx(expected, abs=2e-3)
    best = max(range(len(CHOICES)), key=lambda i: expected[i])
    assert state["answer"] == CHOICES[best]
    assert state.messages()[-1] == {"role": "assistant", "content": CHOICES[best]}


def test_length_normalized_select_decides_by_the_mean(runtime):
    state = sky.run(backend=runtime, choices_method="token_length_normalized")
    scores = state.scores("answer")
    means = scores.normalized_logprobs
    assert state["answer"] == CHOICES[means.index(max(means))]
    assert [len(t) for t in scores.token_ids] == [len(lps) for lps in scores.token_logprobs]


def test_forked_branches_compute_the_shared_prefix_once(runtime):
    @rl.function
    def branches(s):
        s += rl.system(SHARED_SYSTEM)
        s += rl.user("Suggest a repair.")
        s += rl.assistant_begin()
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += f"Option {i + 1}:" + rl.gen("idea", max_tokens=4)
        forks.join()

    runtime.flush_cache()
    before = runtime.stats()
    state = branches.run(backend=runtime, temperature=0)
    delta = _delta(before, runtime.stats())
    assert len(state["idea"]) == 4 and all(isinstance(x, str) for x in state["idea"])
    prompts = [m["prompt_tokens"] for m in state.get_meta_info("idea")["branches"]]
    shared_blocks = len(runtime.encode(state.text())) // BLOCK * BLOCK
    _assert_computed_once(delta, prompts, shared_blocks)


def test_run_batch_programs_compute_their_shared_prefix_once(runtime):
    @rl.function
    def desk(s, question):
        s += rl.system(SHARED_SYSTEM)
        s += rl.user(question)
        s += rl.assistant(rl.gen("answer", max_tokens=2))

    questions = [f"Are you open at {h} o'clock?" for h in (8, 9, 10, 11, 12, 13)]
    runtime.flush_cache()
    before = runtime.stats()
    states = desk.run_batch([{"question": q} for q in questions], backend=runtime, temperature=0)
    delta = _delta(before, runtime.stats())
    prompts = [s.get_meta_info("answer")["prompt_tokens"] for s in states]
    shared = len(runtime.encode(runtime.chat_template.render([{"role": "system", "content": SHARED_SYSTEM}])))
    _assert_computed_once(delta, prompts, shared // BLOCK * BLOCK)


def test_select_scores_every_choice_in_one_batch_over_the_shared_prefix(runtime):
    @rl.function
    def desk(s):
        s += rl.system(SHARED_SYSTEM)
        s += rl.user("Do you fix flat tires?")
        s += rl.assistant(rl.select("answer", choices=["Yes, while you wait.", "No.", "Only on Saturdays.", "Maybe"]))

    runtime.flush_cache()
    before = runtime.stats()
    state = desk.run(backend=runtime)
    delta = _delta(before, runtime.stats())
    scores = state.scores("answer")
    prompts = [len(runtime.encode(state.text().rsplit(state["answer"], 1)[0] + c)) for c in scores.choices]
    prefix = len(runtime.encode(state.text().rsplit(state["answer"], 1)[0]))
    assert delta["prompt_tokens"] == sum(prompts)
    _assert_computed_once(delta, prompts, (prefix - 1) // BLOCK * BLOCK)


def test_text_iter_streams_a_gen(runtime):
    @rl.function
    def story(s):
        s += rl.user("Tell a one-line story.")
        s += rl.assistant(rl.gen("story", max_tokens=12))

    state = story.run(backend=runtime, stream=True, temperature=0)
    pieces = list(state.text_iter("story"))
    assert len(pieces) > 1
    assert "".join(pieces) == state["story"]


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in ("prompt_tokens", "cached_prompt_tokens", "computed_tokens", "generated_tokens")}


def _assert_computed_once(delta: dict, prompts: list[int], shared_blocks: int) -> None:
    """Requests whose prompts share `shared_blocks` tokens of full blocks: all but the first
    read them from the cache, so compute is at most the prompts less those reads, plus decoding."""
    others = len(prompts) - 1
    assert shared_blocks >= 4 * BLOCK  # the test means something only with a real shared prefix
    assert delta["cached_prompt_tokens"] >= others * shared_blocks
    assert delta["computed_tokens"] <= sum(prompts) - others * shared_blocks + delta["generated_tokens"]


def _hf_choice_logprob(model, encode, prefix: str, choice: str) -> float:
    """Sum of log_softmax of the choice's tokens (those after the common token prefix)."""
    prefix_ids, full = encode(prefix), encode(prefix + choice)
    start = next((i for i, (a, b) in enumerate(zip(prefix_ids, full)) if a != b), min(len(prefix_ids), len(full)))
    with torch.inference_mode():
        logits = model(torch.tensor([full])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(logprobs[j - 1, full[j]].item() for j in range(start, len(full)))
