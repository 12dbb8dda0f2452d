"""Incremental detokenization on the real tokenizer: deltas join to the full decode, also
across multi-byte characters split over several tokens."""

import pytest

from radixserve.execution.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


@pytest.mark.parametrize(
    "text",
    [
        " Hello, world! How are you today?",
        " Emoji 🙂🚲 and accents: café, naïve, Übermaß.",
        " 日本語のテキストと中文字符 mixed with English.",
        "\n\ndef f(x):\n    return x ** 2  # tabs\tand spaces",
    ],
)
def test_deltas_join_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("Say something:")
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode(" hi") + [tokenizer.eos_token_id]
    skip = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(skip.add(t) for t in ids) == " hi"
    assert "".join(keep.add(t) for t in ids) == " hi" + tokenizer.eos_token
