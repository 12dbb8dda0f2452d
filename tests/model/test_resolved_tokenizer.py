"""model/resolved_tokenizer.py: a tokenizer.json directory's tokenizer is served from what
transformers built (kept in radixserve's cache, never in the directory) without importing
transformers: the same ids, text, tokens, special tokens, vocabularies and chat renderings as
transformers' own on both real models and every served template (tools, reasoning, None fields,
continued messages, template errors); the file follows its sources; a read-only directory
works; a stale radixserve-tokenizer.json an older version left in the directory is ignored and
kept; what it does not do goes to transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.model.builtin_template import TEMPLATES_DIR as BUILTIN_DIR
from radixserve.model.derived_files import entry_dir
from radixserve.model.resolved_tokenizer import (
    RESOLVED_FILE, ResolvedTokenizer, _key, load_resolved, resolved_state, transformers_tokenizer,
)

TEMPLATES = sorted((Path(__file__).parent.parent / "templates").glob("*.jinja")) + \
    sorted(BUILTIN_DIR.glob("*.jinja"))  # the tests' templates and the built-in ones
TEXTS = ["", "Hello world", "<|im_start|>user\nhi<|im_end|>", "<bos><start_of_turn>user\nx<end_of_turn>",
         "  tabs\t and\n\nlines", "Ünïcödé 🤖 日本語", "don 't , they 're ."]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!", "tool_calls": None}, {"role": "user", "content": "Add 2 and 3."}],
    [{"role": "user", "content": "Add 2 and 3."},
     {"role": "assistant", "content": "", "reasoning_content": "use the tool",
      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
     {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "5"}],
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """radixserve's cache for these tests' resolved tokenizers (not the user's)."""
    return str(tmp_path_factory.mktemp("cache"))


def _copy(model: str | None, tmp_path: Path) -> Path:
    from radixserve.model.loader import resolve_model_path

    source = resolve_model_path(model, float_weights=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, tmp_path / name)
    return tmp_path


def _outcome(call):
    try:
        return call()
    except Exception as exc:  # a template's raise_exception, or a refused argument: the same error both ways
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("model", [None, "gemma3-270m"])
def test_served_without_transformers_as_transformers_serves_it(model, tmp_path, cache):
    directory = _copy(model, tmp_path)
    files = sorted(directory.iterdir())
    theirs = load_resolved(directory, cache)  # a cold cache: transformers' own tokenizer, served as it is
    assert not isinstance(theirs, ResolvedTokenizer) and (entry_dir(directory, cache) / RESOLVED_FILE).is_file()
    ours = load_resolved(directory, cache)
    assert isinstance(ours, ResolvedTokenizer) and sorted(directory.iterdir()) == files  # nothing written there
    for text in TEXTS:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
                assert ours.convert_ids_to_tokens(ids, skip) == theirs.convert_ids_to_tokens(ids, skip)
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id", "pad_token_id",
                 "unk_token_id", "all_special_tokens", "all_special_ids", "vocab_size", "special_tokens_map",
                 "chat_template", "added_tokens_encoder"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    assert ours.get_added_vocab() == theirs.get_added_vocab()
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == \
        {i: (t.content, t.special) for i, t in theirs.added_tokens_decoder.items()}
    assert ours.convert_tokens_to_ids(["<|im_end|>", "no-such-token-here"]) == \
        theirs.convert_tokens_to_ids(["<|im_end|>", "no-such-token-here"])


@pytest.fixture(scope="module")
def default_pair(tmp_path_factory, cache):
    """The default model's resolved tokenizer and transformers' own, loaded once for every template."""
    directory = _copy(None, tmp_path_factory.mktemp("default"))
    theirs = load_resolved(directory, cache)  # a cold cache: transformers' own tokenizer
    ours = load_resolved(directory, cache)
    assert isinstance(ours, ResolvedTokenizer) and not isinstance(theirs, ResolvedTokenizer)
    return ours, theirs


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_served_template_renders_as_transformers_renders_it(template, default_pair):
    ours, theirs = default_pair
    text = template.read_text()
    for messages in CONVERSATIONS:
        for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": False, "tools": TOOLS},
                       {"add_generation_prompt": True, "tools": TOOLS, "enable_thinking": False}):
            want = _outcome(lambda: theirs.apply_chat_template(messages, tokenize=False, chat_template=text, **kwargs))
            assert _outcome(lambda: ours.apply_chat_template(messages, tokenize=False, chat_template=text,
                                                             **kwargs)) == want, kwargs
    prefill = CONVERSATIONS[0][:2] + [{"role": "assistant", "content": "The answer is"}]
    want = _outcome(lambda: theirs.apply_chat_template(prefill, tokenize=False, chat_template=text,
                                                       continue_final_message=True))
    assert _outcome(lambda: ours.apply_chat_template(prefill, tokenize=False, chat_template=text,
                                                     continue_final_message=True)) == want


def test_the_file_follows_its_sources_and_the_rest_goes_to_transformers(tmp_path, cache):
    directory = _copy(None, tmp_path)
    load_resolved(directory, cache)
    assert isinstance(load_resolved(directory, cache), ResolvedTokenizer)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_start|>"}))
    stale = load_resolved(directory, cache)  # another eos: resolved again by transformers, the file rewritten
    assert not isinstance(stale, ResolvedTokenizer) and stale.eos_token == "<|im_start|>"
    ours, theirs = load_resolved(directory, cache), transformers_tokenizer(directory)
    assert ours.eos_token == "<|im_start|>" == theirs.eos_token
    messages = CONVERSATIONS[0]
    assert ours.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == \
        theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)  # tokenize=True
    assert ours.padding_side == theirs.padding_side  # an attribute it does not keep: transformers' own


def test_special_tokens_split_as_the_config_says(tmp_path, cache):
    directory = _copy(None, tmp_path)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}))
    load_resolved(directory, cache)
    ours, theirs = load_resolved(directory, cache), transformers_tokenizer(directory)
    text = "<|im_start|>user\nhi<|im_end|>"
    assert isinstance(ours, ResolvedTokenizer) and ours.encode(text) == theirs.encode(text)
    (tmp_path / "plain").mkdir()
    assert len(ours.encode(text)) > len(transformers_tokenizer(_copy(None, tmp_path / "plain")).encode(text))


def test_a_served_tokenizer_imports_no_transformers(tmp_path, cache):
    """The resident-memory point of it: loading and using a resolved tokenizer never imports
    transformers (~18 MiB in a serving process)."""
    directory = _copy(None, tmp_path)
    load_resolved(directory, cache)
    code = (f"import sys; from radixserve.model.tokenizer import load_tokenizer; t = load_tokenizer({str(directory)!r}, cache_dir={cache!r}); "
            "t.decode(t.encode('hi')); t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False); "
            "print(type(t).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["ResolvedTokenizer", "False"]


def test_a_read_only_directory_is_served_resolved_and_left_as_it_was(tmp_path, cache):
    directory = _copy(None, tmp_path)
    files = {p.name: p.read_bytes() for p in directory.iterdir()}
    directory.chmod(0o555)
    try:
        assert not isinstance(load_resolved(directory, cache), ResolvedTokenizer)
        ours = load_resolved(directory, cache)
        assert isinstance(ours, ResolvedTokenizer) and ours.encode("Hello world") == \
            transformers_tokenizer(directory).encode("Hello world")
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == files
    finally:
        directory.chmod(0o755)


def test_a_stale_file_an_older_version_left_in_the_directory_is_ignored_and_kept(tmp_path, cache):
    directory = _copy(None, tmp_path)
    state = resolved_state(transformers_tokenizer(directory))
    state["special_tokens_map"] = {**state["special_tokens_map"], "eos_token": "<|im_start|>"}
    stale = json.dumps({"key": _key(directory), "tokenizer": state})  # as older versions wrote it, today's key
    (directory / "radixserve-tokenizer.json").write_text(stale)
    load_resolved(directory, cache)
    ours = load_resolved(directory, cache)
    assert isinstance(ours, ResolvedTokenizer) and ours.eos_token == "<|im_end|>"
    assert (directory / "radixserve-tokenizer.json").read_text() == stale
