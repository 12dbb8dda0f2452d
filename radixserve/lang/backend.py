"""Backend: what a program runs on (an in-process Runtime or an HTTP Endpoint), and the
default backend programs use when `run` is given none.

Both backends tokenize on the client side with the same tokenizer (`encode`), send token
ids, and must be safe to call from many program threads at once: every call blocks its
own thread while the backend batches the calls of all threads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.lang.chat_template import ChatTemplate
from radixserve.lang.choice_scoring import ScoreRequest
from radixserve.sampling_params import SamplingParams

TextCallback = Callable[[str], None]


@dataclass(frozen=True)
class Completion:
    """One finished generation."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def meta(self) -> dict[str, Any]:
        return {
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
        }


class Backend(ABC):
    """Generation and choice scoring over token ids; thread-safe."""

    _chat_template: ChatTemplate | None = None

    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer."""

    @abstractmethod
    def generate(self, prompt_ids: list[int], params: SamplingParams, on_text: TextCallback | None = None) -> Completion:
        """Generate after `prompt_ids`; `on_text(delta)` sees the text as it grows. The
        built-in backends also take `session_id=` (an agent session, a cache hint).
        Raises ValueError for a request the engine refuses (bad regex, too long...)."""

    @abstractmethod
    def score(self, requests: list[ScoreRequest]) -> list[list[float]]:
        """Log-probabilities of `token_ids[start:]` of every request, all in one batch."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Cumulative engine counters: prompt_tokens, cached_prompt_tokens, ..."""

    def shutdown(self) -> None:
        """Release what the backend holds (threads, connections)."""

    @property
    def chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            self._chat_template = ChatTemplate(self.tokenizer)
        return self._chat_template

    def encode(self, text: str) -> list[int]:
        """Token ids of a program's text. A text that already starts with the BOS token
        (a chat template wrote it) gets no second one."""
        tokenizer = self.tokenizer
        bos = getattr(tokenizer, "bos_token", None)
        with_specials = not (bos and text.startswith(bos))
        return tokenizer.encode(text, add_special_tokens=with_specials)

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def hit_rate(stats: dict[str, Any], before: dict[str, Any] | None = None) -> float:
    """Cached prompt tokens / prompt tokens, over the whole run or since `before`."""
    before = before or {}
    prompt = stats["prompt_tokens"] - before.get("prompt_tokens", 0)
    cached = stats["cached_prompt_tokens"] - before.get("cached_prompt_tokens", 0)
    return cached / prompt if prompt else 0.0


_default: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """The backend `run` and `run_batch` use when they are given none."""
    global _default
    if backend is not None and not isinstance(backend, Backend):
        raise TypeError(f"a backend is an rl.Runtime or rl.Endpoint, got {type(backend).__name__}")
    _default = backend


def get_default_backend() -> Backend | None:
    return _default


def resolve_backend(backend: Backend | None) -> Backend:
    chosen = backend if backend is not None else _default
    if chosen is None:
        raise ValueError("no backend: pass backend=rl.Runtime() (or rl.Endpoint(url)), or call rl.set_default_backend")
    return chosen
