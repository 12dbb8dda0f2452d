"""A model-free backend for radixserve.lang unit tests: a character tokenizer with a
ChatML template, deterministic generations, and scores that depend on the token ids."""

from __future__ import annotations

import threading
from typing import Any

from radixserve.lang.backend import Backend, Completion
from radixserve.lang.choice_scoring import ScoreRequest
from radixserve.sampling_params import SamplingParams

DEFAULT_SYSTEM = "You are a test assistant."


class CharTokenizer:
    """One token per character; renders ChatML, adding a default system message when the
    conversation does not start with one (like SmolLM2's template)."""

    chat_template = "chatml"
    bos_token = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False) -> str:
        if not messages:
            raise ValueError("empty conversation")
        out = ""
        if messages[0]["role"] != "system":
            out += f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
        for m in messages:
            out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        if add_generation_prompt:
            out += "<|im_start|>assistant\n"
        return out


class FakeBackend(Backend):
    """generate: `reply` (a function of the prompt text and params) streamed a character at a
    time; score: each token's logprob is -(token id % 10) / 10. Records every call."""

    def __init__(self, reply=None, barrier: threading.Barrier | None = None):
        self._tokenizer = CharTokenizer()
        self.reply = reply or (lambda prompt, params: f"<{len(prompt)}>")
        self.barrier = barrier  # generate waits here: proves that calls run concurrently
        self.calls: list[tuple[str, Any]] = []
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def generate(self, prompt_ids: list[int], params: SamplingParams, on_text=None) -> Completion:
        prompt = "".join(chr(i) for i in prompt_ids)
        with self._lock:
            self.calls.append(("generate", prompt, params))
        if self.barrier is not None:
            self.barrier.wait(timeout=10)
        text = self.reply(prompt, params)
        if on_text is not None:
            for ch in text:
                on_text(ch)
        return Completion(text, [ord(c) for c in text], "stop", len(prompt_ids), 0)

    def score(self, requests: list[ScoreRequest]) -> list[list[float]]:
        with self._lock:
            self.calls.append(("score", requests, None))
        return [[-(t % 10) / 10 for t in r.token_ids[r.start:]] for r in requests]

    def stats(self) -> dict[str, Any]:
        return {"prompt_tokens": 0, "cached_prompt_tokens": 0}
