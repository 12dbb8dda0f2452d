"""engine/inputs.py's character bound (max_chars_per_token): read from the tokenizer's
normalizer, pre-tokenizer and model alone, it decides as the whole tokenizer.json would."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from radixserve.engine.inputs import _spec, max_chars_per_token


def _wrapped(backend: Tokenizer) -> SimpleNamespace:
    return SimpleNamespace(backend_tokenizer=backend, get_vocab=lambda: backend.get_vocab(with_added_tokens=True))


def _bpe(**options) -> Tokenizer:
    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "abab": 4}
    return Tokenizer(models.BPE(vocab, [("a", "b"), ("ab", "ab")], **options))


def test_the_components_read_alone_are_those_of_the_whole_json(real_engine):
    backend = real_engine.tokenizer.backend_tokenizer
    whole = json.loads(backend.to_str())
    assert _spec(backend.normalizer) == whole.get("normalizer")
    assert _spec(backend.pre_tokenizer) == whole.get("pre_tokenizer") is not None
    assert max_chars_per_token(real_engine.tokenizer) == 81  # SmolLM2's longest token


def test_lossless_bpe_is_bounded_and_anything_else_is_not():
    plain = _bpe()
    plain.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    plain.pre_tokenizer = pre_tokenizers.Metaspace()
    assert max_chars_per_token(_wrapped(plain)) == 5  # "<unk>"
    lowered = _bpe()
    lowered.normalizer = normalizers.Lowercase()  # not lossless: no bound
    assert max_chars_per_token(_wrapped(lowered)) is None
    removed = _bpe()
    removed.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
    assert max_chars_per_token(_wrapped(removed)) is None
    assert max_chars_per_token(_wrapped(_bpe(unk_token="<unk>", fuse_unk=True))) is None
    assert max_chars_per_token(_wrapped(_bpe(unk_token="<unk>"))) == 5
    assert max_chars_per_token(_wrapped(Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))) is None
    assert max_chars_per_token(SimpleNamespace()) is None
