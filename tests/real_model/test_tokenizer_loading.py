"""model/tokenizer.py loads tokenizer.json through transformers' generic class instead of the
family's own (GemmaTokenizer rebuilds its vocabulary in Python: ~250 MiB): it must tokenize,
decode and template exactly as AutoTokenizer does, for both real models."""

from __future__ import annotations

import pytest

from radixserve.model.builtin_template import builtin_template
from radixserve.model.tokenizer import load_tokenizer
from real_prompts import RAW

pytestmark = [pytest.mark.real_model]

TEXTS = [
    "", " ", "Hello world", "<|im_start|>user\nhi<|im_end|>", "<start_of_turn>user\n<bos>x<eos><end_of_turn>",
    "  leading\ttabs\n\n\nnew lines", "Ünïcödé 🤖 日本語のテキスト ﷺ", "def f(x):\n    return x**2  # comment",
    "a" * 300, "<unk><pad></s><s>", "<tool_call>{\"name\": \"f\"}</tool_call>", *RAW[:8],
]


def _model_dir(name: str):
    from radixserve.model.loader import resolve_model_path

    try:
        return resolve_model_path(name, float_weights=False)
    except FileNotFoundError as exc:  # pragma: no cover - setup.sh installs both
        pytest.fail(f"{name} unavailable: {exc}")


@pytest.mark.parametrize("model", [None, "gemma3-270m"])
def test_the_generic_class_tokenizes_decodes_and_templates_as_autotokenizer(model):
    from transformers import AutoTokenizer

    directory = _model_dir(model)
    ours, auto = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert len(ours) == len(auto) and ours.get_vocab() == auto.get_vocab()
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids"):
        assert getattr(ours, attr) == getattr(auto, attr), attr
    # the model's own template, or (Gemma 3's GGUF has none) its family's built-in one
    assert ours.chat_template == (auto.chat_template or builtin_template("gemma3"))
    auto.chat_template = ours.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = auto.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
            assert ours.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    if auto.chat_template:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[6]}]
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
