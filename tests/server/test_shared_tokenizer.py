"""The server reads the engine's own tokenizer from the event loop (token texts, reasoning),
no copy of it: concurrent reads of one fast tokenizer give what reads one at a time give."""

from __future__ import annotations

import threading

import pytest

from radixserve.server import ServerOptions, create_app
from radixserve.server.token_text import TokenTexts

pytestmark = pytest.mark.real_model

TEXTS = ["The capital of France is Paris. " * 40, "Ünïcödé, emoji 🎉 and 中文 text " * 30, "def f(x):\n    return x\n" * 50]


def test_the_app_holds_the_engines_tokenizer_and_no_copy(engine):
    state = create_app(engine, ServerOptions(reasoning_parser="qwen3")).state.server
    assert state.texts.tokenizer is engine.tokenizer
    assert state.reasoning.tokenizer is engine.tokenizer
    assert state.reasoning.for_template("{{ messages }}").tokenizer is engine.tokenizer
    ids = engine.tokenizer.encode("one two three")
    skip = not state.reasoning.parser.keeps_special_tokens
    assert state.reasoning.mode({}).decode(ids) == engine.tokenizer.decode(ids, skip_special_tokens=skip)


def test_threads_reading_one_tokenizer_at_once_get_the_serial_results(engine):
    tokenizer = engine.tokenizer
    texts = TokenTexts(tokenizer)
    want_ids = [tokenizer.encode(t) for t in TEXTS]
    want_text = [tokenizer.decode(ids, skip_special_tokens=False) for ids in want_ids]
    want_pieces = [tokenizer.convert_ids_to_tokens(i) for i in want_ids[1]]
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def encoding() -> None:
        start.wait()
        for _ in range(60):
            assert [tokenizer.encode(t) for t in TEXTS] == want_ids

    def decoding() -> None:
        start.wait()
        for _ in range(60):
            assert [texts.decode(ids) for ids in want_ids] == want_text
            assert [texts.tokenizer.convert_ids_to_tokens(i) for i in want_ids[1]] == want_pieces
            texts.bytes.cache_clear()
            assert b"".join(texts.bytes(i) for i in want_ids[1]).decode() == want_text[1]

    def run(fn) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in (encoding, encoding, decoding, decoding)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
