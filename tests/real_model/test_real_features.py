"""Stop strings, the CLI and text prompts on the real model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from radixserve import SamplingParams

pytestmark = pytest.mark.real_model


def test_stop_string_ends_generation_and_is_not_in_the_text(real_engine):
    prompt = real_engine.apply_chat_template([{"role": "user", "content": "Count from one to ten in words."}])
    free = real_engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    words = free.text.split()
    assert len(words) > 3
    stop = words[2]
    out = real_engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]))[0]
    cut = free.text.index(stop)
    assert out.text == free.text[:cut]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < len(free.token_ids)
    kept = real_engine.generate(
        [prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop], include_stop_str_in_output=True)
    )[0]
    assert kept.text == free.text[: cut + len(stop)]


def test_text_prompts_tokenize_like_the_tokenizer(real_engine):
    text = "The three primary colours are"
    by_text = real_engine.generate(text, SamplingParams(max_tokens=8, temperature=0.0))[0]
    by_ids = real_engine.generate([real_engine.tokenizer.encode(text)], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert by_text.token_ids == by_ids.token_ids and by_text.prompt == text


def test_streamed_text_never_shows_a_partial_stop_string(real_engine):
    """The greedy answer is "The alphabet is a series of symbols that represent the letters
    ..."; the stop string spans two tokens (" represent", " the"), so after the first of them
    the text ends in a partial stop string that the stream must hold back."""
    prompt = real_engine.apply_chat_template([{"role": "user", "content": "Write the alphabet."}])
    stop = " represent the"
    free = real_engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0))[0]
    assert stop in free.text and " represent" in [real_engine.tokenizer.decode([t]) for t in free.token_ids]
    rid = real_engine.add_request(prompt, SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]))
    outs = []
    while real_engine.has_unfinished_requests():
        outs += [o for o in real_engine.step() if o.request_id == rid]
    final = outs[-1]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert final.text == free.text[: free.text.index(stop)]
    assert len(outs) > 3
    for partial in outs[:-1]:
        assert final.text.startswith(partial.text), (partial.text, final.text)  # no " represent" shown


def test_cli_generate_prints_the_chat_completion(real_engine, real_model_dir):
    question = "What is the capital of Italy?"
    prompt = real_engine.apply_chat_template([{"role": "user", "content": question}])
    expected = real_engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].text
    run = subprocess.run(
        [sys.executable, "-m", "radixserve", "generate", question, "--max-tokens", "12", "--model", str(real_model_dir)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected + "\n"


def test_cli_reports_a_missing_model_in_one_line(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "radixserve", "generate", "hi", "--model", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "not found" in run.stderr


def test_bf16_prefill_tracks_float32_on_the_real_model(real_engine, real_model_dir):
    """bf16 attention and layer matmuls for the prompt (where the CPU has them): a ~700-token
    chat prompt's logprobs stay within bf16's rounding of float32's and the greedy reply (decoded
    in float32 after the bf16 prompt) is float32's; the pool stays intact."""
    from radixserve import Engine
    from radixserve.kernels.onednn_linear import bf16_available
    from real_prompts import CHAT, RAW

    if not (bf16_available() and real_engine.runner.backend.name == "cpu"
            and real_engine.runner.backend._kernels.has_bf16_prefill(real_engine.loaded.spec.head_dim)):
        pytest.skip("no native bf16 on this CPU")
    text = "Summarize the following notes in one sentence.\n\n" + "\n\n".join(RAW + CHAT) * 2
    ids = real_engine.apply_chat_template([{"role": "user", "content": text}])
    params = SamplingParams(max_tokens=24, temperature=0.0, prompt_logprobs=0)
    bf16 = Engine(str(real_model_dir), prefill_attention_dtype="bfloat16", prefill_matmul_dtype="bfloat16")
    ours, theirs = bf16.generate([ids], params)[0], real_engine.generate([ids], params)[0]
    differences = [abs(a.logprob - b.logprob) for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:])]
    assert len(differences) == len(ids) - 1
    # measured 0.014-0.016 nats on real text (bench_prefill --compare bf16-all --accuracy)
    assert sum(differences) / len(differences) < 0.05
    assert ours.token_ids == theirs.token_ids
    bf16.check_integrity()
    real_engine.check_integrity()
