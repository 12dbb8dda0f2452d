"""ReplySplicer: a re-sent reply is prompted with the ids it was generated as; everything
else tokenizes as before; ids that do not decode to the reply's text are never spliced."""

from __future__ import annotations

import shutil

import pytest

from radixserve import Engine, SamplingParams
from radixserve.engine.reply_ids import MAX_MISSES, ReplySplicer, TurnMarks, reply_spans, turn_marks
from tiny_models import build_tiny_model

USER = [{"role": "user", "content": "Hi"}]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class Replies:
    """A ReplyLookup over a list (the server's is ReplyIdStore, per namespace): replies given
    as {text: ids} follow any prompt; `add` ties one to the prompt it answered."""

    def __init__(self, anywhere: dict[str, list[int]] | None = None):
        self.entries = [(None, text, ids) for text, ids in (anywhere or {}).items()]

    def add(self, prompt_ids, text, ids):
        self.entries.append((tuple(prompt_ids), text, list(ids)))

    def may_begin(self, text):
        return True

    def replies_after(self, prompt_ids):
        return [(text, ids) for prompt, text, ids in self.entries if prompt in (None, tuple(prompt_ids))]


@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


@pytest.fixture(scope="module")
def tiny_chat_engine(real_model_dir, tmp_path_factory):
    """A tiny random Llama with the default model's tokenizer and ChatML template: it writes
    token sequences that re-tokenize differently, quickly."""
    directory = build_tiny_model("llama", tmp_path_factory.mktemp("tiny-chat"), vocab_size=49152)
    for name in TOKENIZER_FILES:
        if (real_model_dir / name).is_file():
            shutil.copy(real_model_dir / name, directory / name)
    return Engine(str(directory))


def render(tokenizer, messages, generation_prompt=True) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def plain(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_chatml_turn_marks(tokenizer):
    assert turn_marks(tokenizer) == TurnMarks("<|im_start|>assistant\n", "<|im_end|>")
    marks = turn_marks(tokenizer)
    text = render(tokenizer, USER + [{"role": "assistant", "content": "A"}, {"role": "user", "content": "B"},
                                     {"role": "assistant", "content": "C"}, {"role": "user", "content": "D"}])
    assert [text[a:b] for a, b in reply_spans(text, marks)] == ["A", "C"]


def test_turn_marks_come_from_the_template_in_force(tokenizer):
    template = ("{% for m in messages %}<|im_start|>{{ 'bot' if m.role == 'assistant' else m.role }}: {{ m.content }}"
                "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>bot: {% endif %}")
    assert turn_marks(tokenizer, template) == TurnMarks("<|im_start|>bot: ", "<|im_end|>")
    assert ReplySplicer(tokenizer, template).marks == TurnMarks("<|im_start|>bot: ", "<|im_end|>")
    assert turn_marks(tokenizer, "{{ messages[0].content }}") is None  # no generation prompt: nothing to splice


def test_a_stored_reply_is_spliced_where_it_was_generated(tokenizer):
    """The reply's own split ("Hel" + "lo world", not "Hello" + " world"), after exactly the
    ids of the prompt it answered, and its stop token where the template closes the turn."""
    prompt = plain(tokenizer, render(tokenizer, USER))
    generated = plain(tokenizer, "Hel") + plain(tokenizer, "lo world") + [tokenizer.eos_token_id]
    store = Replies({"Hello world": generated})
    text = render(tokenizer, USER + [{"role": "assistant", "content": "Hello world"}, {"role": "user", "content": "more"}])
    ids = ReplySplicer(tokenizer).encode(text, store)
    assert ids[: len(prompt) + len(generated)] == prompt + generated
    assert ids != plain(tokenizer, text)
    assert tokenizer.decode(ids) == text
    assert ids[len(prompt) + len(generated):] == plain(tokenizer, text)[-len(ids) + len(prompt) + len(generated):]


def test_a_turn_holding_more_than_the_reply_gets_its_ids_then_the_rest(tokenizer):
    """A call max_tokens cut right after its arguments renders with the close the model never
    wrote: the reply's ids come first, the close is encoded after them."""
    reply = '<tool_call>\n{"name": "add", "arguments": {"a": 1}'
    generated = plain(tokenizer, reply[:20]) + plain(tokenizer, reply[20:])
    store = Replies()
    store.add(plain(tokenizer, render(tokenizer, USER)), reply, generated)
    turn = reply + "}\n</tool_call>"
    text = render(tokenizer, USER + [{"role": "assistant", "content": turn}, {"role": "user", "content": "x"}])
    prompt = plain(tokenizer, render(tokenizer, USER))
    ids = ReplySplicer(tokenizer).encode(text, store)
    assert ids[: len(prompt) + len(generated)] == prompt + generated
    assert ids[len(prompt) + len(generated):][: len(plain(tokenizer, "}\n</tool_call>"))] == \
        plain(tokenizer, "}\n</tool_call>")
    assert tokenizer.decode(ids) == text


def test_a_reply_is_found_only_after_the_prompt_it_answered(tokenizer):
    store = Replies()
    store.add([1, 2, 3], "Hello world", plain(tokenizer, "Hel") + plain(tokenizer, "lo world"))
    text = render(tokenizer, USER + [{"role": "assistant", "content": "Hello world"}, {"role": "user", "content": "x"}])
    assert ReplySplicer(tokenizer).encode(text, store) == plain(tokenizer, text)


def test_lookups_stop_after_a_run_of_misses(tokenizer):
    """Each miss encodes the text since the last splice again: after MAX_MISSES in a row the
    rest is encoded as ever, so a long conversation never costs more than a few encodings."""
    calls = []

    class Misses(Replies):
        def replies_after(self, prompt_ids):
            calls.append(len(prompt_ids))
            return []

    messages = list(USER)
    for turn in range(MAX_MISSES + 4):
        messages += [{"role": "assistant", "content": f"Reply {turn}"}, {"role": "user", "content": "more"}]
    text = render(tokenizer, messages)
    assert ReplySplicer(tokenizer).encode(text, Misses()) == plain(tokenizer, text)
    assert len(calls) == MAX_MISSES


def test_ids_that_decode_to_other_text_are_not_spliced(tokenizer):
    store = Replies({"Hello world": plain(tokenizer, "Hello world!")})
    text = render(tokenizer, USER + [{"role": "assistant", "content": "Hello world"}, {"role": "user", "content": "x"}])
    assert ReplySplicer(tokenizer).encode(text, store) == plain(tokenizer, text)


def test_a_splice_that_changes_the_whole_text_is_refused(tokenizer):
    """A tokenizer that marks the start of every text it encodes (as a SentencePiece prefix
    space does) would change the pieces around a reply: the whole is encoded instead."""

    class PrefixSpace:
        chat_template = tokenizer.chat_template

        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode(self, text, add_special_tokens=False):
            return plain(tokenizer, " ") + plain(tokenizer, text)

    store = Replies({"Hello world": plain(tokenizer, "Hel") + plain(tokenizer, "lo world")})
    text = render(tokenizer, USER + [{"role": "assistant", "content": "Hello world"}, {"role": "user", "content": "x"}])
    assert ReplySplicer(PrefixSpace()).encode(text, store) == PrefixSpace().encode(text)


def test_without_a_stored_reply_the_text_tokenizes_as_before(tokenizer):
    text = render(tokenizer, USER + [{"role": "assistant", "content": "Hello world"}, {"role": "user", "content": "x"}])
    splicer = ReplySplicer(tokenizer)
    assert splicer.encode(text, Replies({"Hello": [1]})) == plain(tokenizer, text)
    assert splicer.encode(text, None) == plain(tokenizer, text)
    assert splicer.encode(text, Replies({"Hello world": plain(tokenizer, "Hel") + plain(tokenizer, "lo world")})) \
        != plain(tokenizer, text)


def test_the_tiny_model_is_prompted_with_exactly_what_it_generated(tiny_chat_engine):
    """Turns on a tiny random model: each next prompt begins with the prompt before it and
    every id the model generated, although the text re-tokenizes otherwise."""
    engine, tokenizer = tiny_chat_engine, tiny_chat_engine.tokenizer
    store = Replies()
    messages = [{"role": "user", "content": "Say something."}]
    differed = 0
    for turn in range(4):
        prompt = engine.apply_chat_template(messages, replies=store)
        out = engine.generate(prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=turn))[0]
        store.add(prompt, out.text, out.token_ids)
        messages = messages + [{"role": "assistant", "content": out.text}, {"role": "user", "content": f"Go on {turn}."}]
        following = engine.apply_chat_template(messages, replies=store)
        written = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids  # less its stop token
        if tokenizer.decode(written, skip_special_tokens=False) != out.text:
            continue  # a special token the text leaves out: no ids decode to the text, none are spliced
        assert following[: len(prompt) + len(out.token_ids)] == prompt + list(out.token_ids)
        differed += plain(tokenizer, out.text) != list(out.token_ids)[: len(plain(tokenizer, out.text))]
    assert differed  # not vacuous: a re-tokenization would have split some reply otherwise


def test_the_real_model_is_prompted_with_exactly_what_it_generated(real_engine):
    store = Replies()
    messages = [{"role": "user", "content": "Name three fruits, comma separated."}]
    prompt = real_engine.apply_chat_template(messages, replies=store)
    out = real_engine.generate(prompt, SamplingParams(max_tokens=20, temperature=0))[0]
    store.add(prompt, out.text, out.token_ids)
    messages += [{"role": "assistant", "content": out.text}, {"role": "user", "content": "And three more."}]
    following = real_engine.apply_chat_template(messages, replies=store)
    generated = list(out.token_ids) + ([] if out.finish_reason == "stop" else [2])  # the template closes a cut turn
    assert following[: len(prompt) + len(generated)] == prompt + generated
