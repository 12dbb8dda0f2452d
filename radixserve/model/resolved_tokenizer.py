"""ResolvedTokenizer: a tokenizer.json directory's tokenizer as transformers builds it, kept
beside it, so that a serving process never imports transformers for it.

transformers' TokenizersBackend finishes the file's tokenizer when it loads it (its
post-processor from add_bos_token / add_eos_token, the special tokens added, truncation
off) and keeps the special tokens' roles and the chat template; importing it costs ~18 MiB
resident (its hub client, httpx, PIL...) in a process that only encodes, decodes and renders.
So the tokenizer transformers built is written once as `resolved-tokenizer.json` in the
directory's entry of radixserve's cache (model/derived_files.py: keyed by the tokenizer files'
bytes, transformers' version and the directory's path; never written into the model directory):
the backend's own serialization and the attributes read from it. Later loads build a
`tokenizers.Tokenizer` from it (the same Rust state: the same ids and text) and render chat
templates with model/chat_renderer.py. What is used seldom (tokenize=True, assistant masks,
save_pretrained, xgrammar's TokenizerInfo...) goes to transformers' tokenizer, loaded the first
time it is asked for. Where the cache cannot be written, transformers' tokenizer is used as it is.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import threading
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from radixserve.model.chat_renderer import render_chat
from radixserve.model.derived_files import read_derived, write_derived

RESOLVED_FILE = "resolved-tokenizer.json"  # its name in the directory's entry of the cache
SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                "chat_template.json")
SPECIAL_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_TEXT_ARGS = {"tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message", "tokenize",
              "return_dict"}
_NOT_TEMPLATE_VARIABLES = {"padding", "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask",
                           "tokenizer_kwargs", "sanitize_control_tokens"}


class ResolvedTokenizer:
    """The tokenizer a serving process uses: encode, decode, vocabularies, special tokens and
    chat templates as transformers' tokenizer of the same directory gives them."""

    def __init__(self, path: Path, state: dict[str, Any]):
        self.name_or_path = str(path)
        self.backend_tokenizer = Tokenizer.from_str(state["backend"])
        self.backend_tokenizer.encode_special_tokens = state.get("split_special_tokens", False)  # not in its JSON
        self.chat_template = state["chat_template"]
        self.special_tokens_map: dict[str, str] = state["special_tokens_map"]
        self.all_special_tokens: list[str] = state["all_special_tokens"]
        self.all_special_ids: list[int] = state["all_special_ids"]
        self.clean_up_tokenization_spaces: bool = state["clean_up_tokenization_spaces"]
        self.added_tokens_decoder = {int(i): AddedToken(t["content"], special=t["special"])
                                     for i, t in state["added_tokens"].items()}
        self._bpe = type(self.backend_tokenizer.model).__name__ == "BPE"
        self._transformers: Any = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # copies and pickles: transformers' own is loaded again if asked for
        return {k: v for k, v in self.__dict__.items() if k not in ("_transformers", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _transformers=None, _lock=threading.Lock())

    # ---- special tokens -------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_transformers", "_lock", "special_tokens_map"):
            raise AttributeError(name)
        if name in SPECIAL_ATTRIBUTES:
            return self.special_tokens_map.get(name)
        if name.endswith("_token_id") and name.removesuffix("_id") in SPECIAL_ATTRIBUTES:
            token = self.special_tokens_map.get(name.removesuffix("_id"))
            return None if token is None else self.backend_tokenizer.token_to_id(token)
        return getattr(self.as_transformers(), name)

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {t.content: i for i, t in sorted(self.added_tokens_decoder.items())}

    def get_added_vocab(self) -> dict[str, int]:
        return self.added_tokens_encoder

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    # ---- ids and text -----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self.as_transformers().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if isinstance(token_ids, dict):
            token_ids = token_ids["input_ids"]
        text = self.backend_tokenizer.decode([int(i) for i in token_ids], skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean and not self._bpe:  # transformers skips the clean-up for BPE (it would strip real spaces)
            return clean_up_tokenization(text)
        return text

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str) -> int | None:
        index = self.backend_tokenizer.token_to_id(token)
        return self.unk_token_id if index is None else index

    # ---- chat ---------------------------------------------------------------------------

    def apply_chat_template(self, conversation: Any, tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False, tokenize: bool = True, **kwargs: Any) -> Any:
        """tokenize=False on one conversation of message dicts with JSON-schema tools renders
        here; anything else goes to transformers' own."""
        batched = isinstance(conversation, (list, tuple)) and bool(conversation) and (
            isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages"))
        plain_tools = tools is None or all(isinstance(t, dict) for t in tools)
        if tokenize or batched or not plain_tools or _NOT_TEMPLATE_VARIABLES & kwargs.keys():
            return self.as_transformers().apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=tokenize, **kwargs)
        return render_chat(self._template(chat_template, tools), conversation, self.special_tokens_map, tools=tools,
                           documents=documents, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, **kwargs)

    def _template(self, chat_template: str | None, tools: list | None) -> str:
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in own:
                    return own["tool_use"]
                if "default" in own:
                    return own["default"]
                raise ValueError("This model has multiple chat templates with no default specified! Pass one of "
                                 f"{sorted(own)} as chat_template.")
        if chat_template is not None:
            return chat_template
        if own is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set and no "
                             "template argument was passed!")
        return own

    # ---- transformers' own ---------------------------------------------------------------

    def as_transformers(self) -> Any:
        """transformers' tokenizer of the same directory (loaded once, when first asked for),
        its chat template this one's."""
        with self._lock:
            if self._transformers is None:
                self._transformers = transformers_tokenizer(Path(self.name_or_path))
            self._transformers.chat_template = self.chat_template
            return self._transformers


def clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of spaces before punctuation and contractions (WordPiece's)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def load_resolved(path: Path, cache_dir: str | None = None) -> Any:
    """The directory's tokenizer: a ResolvedTokenizer from the cache when it matches the
    tokenizer files and this transformers, else transformers' (and kept in the cache for next time)."""
    key = _key(path)
    state = read_derived(path, RESOLVED_FILE, key, cache_dir)
    if isinstance(state, dict):
        return ResolvedTokenizer(path, state)
    tokenizer = transformers_tokenizer(path)
    try:
        state = resolved_state(tokenizer)
    except (TypeError, ValueError):
        return tokenizer
    write_derived(path, RESOLVED_FILE, key, state, cache_dir)
    return tokenizer


def transformers_tokenizer(path: Path) -> Any:
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(path)


def resolved_state(tokenizer: Any) -> dict[str, Any]:
    """What a ResolvedTokenizer reads of transformers' tokenizer."""
    return {
        "backend": tokenizer.backend_tokenizer.to_str(),
        "chat_template": tokenizer.chat_template,
        "special_tokens_map": dict(tokenizer.special_tokens_map),
        "all_special_tokens": list(tokenizer.all_special_tokens),
        "all_special_ids": list(tokenizer.all_special_ids),
        "clean_up_tokenization_spaces": bool(tokenizer.clean_up_tokenization_spaces),
        "split_special_tokens": bool(getattr(tokenizer, "split_special_tokens", False)),
        "added_tokens": {str(i): {"content": t.content, "special": bool(t.special)}
                         for i, t in tokenizer.added_tokens_decoder.items()},
    }


def _key(path: Path) -> dict[str, str]:
    digest = hashlib.sha256()
    for name in SOURCE_FILES:
        file = path / name
        digest.update(name.encode() + b"\0" + (file.read_bytes() if file.is_file() else b"-") + b"\0")
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"files_sha256": digest.hexdigest(), "transformers": version}
