"""`@rl.function`: a Python function over a state becomes a program with `run` / `run_batch`.

    @rl.function
    def qa(s, question):
        s += rl.user(question)
        s += rl.assistant(rl.gen("answer", max_tokens=64))

    state = qa.run(question="...", backend=rl.Runtime(), temperature=0)
    states = qa.run_batch([{"question": q} for q in questions], progress_bar=True)
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
from collections.abc import Callable
from typing import Any

from radixserve.lang.backend import Backend, resolve_backend
from radixserve.lang.state import ProgramState
from radixserve.sampling_params import SamplingParams

SAMPLING_DEFAULTS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed")
RESERVED = ("backend", "stream", "num_threads", "progress_bar", "session_id", *SAMPLING_DEFAULTS)
MAX_THREADS = 64


def function(fn: Callable[..., Any]) -> "Program":
    """Decorator: `fn(s, ...)` appends to the state `s`; see Program."""
    return Program(fn)


class Program:
    """A program: `run` it once, `run_batch` it over many argument sets, or call it as
    `prog(s, ...)` from inside another program to append to that program's state."""

    def __init__(self, fn: Callable[..., Any]):
        params = list(inspect.signature(fn).parameters)
        if not params:
            raise TypeError(f"{fn.__name__} must take the state as its first argument")
        clash = sorted(set(params[1:]) & set(RESERVED))
        if clash:
            raise TypeError(f"{fn.__name__}: parameter name(s) {', '.join(clash)} are reserved by run()")
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:
        return self.fn(s, *args, **kwargs)

    def run(
        self,
        *args: Any,
        backend: Backend | None = None,
        stream: bool = False,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        seed: int | None = None,
        session_id: str | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program; returns its state once everything ran (with `stream=True`, as soon
        as the function returned: read `state.text_iter()` meanwhile). The sampling options
        are defaults for the program's gens; the function's return value is `state.ret_value`.
        Raises what the program raised. `session_id` names the agent conversation the run
        continues: its gens keep their context ahead of other cached prefixes."""
        defaults = _sampling_defaults(max_tokens, temperature, top_p, top_k, min_p, seed)
        state = ProgramState(resolve_backend(backend), defaults, stream=stream, session_id=session_id)
        state.ret_value = self.fn(state, *args, **kwargs)
        if not stream:
            state.sync()
        return state

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        seed: int | None = None,
    ) -> list[ProgramState]:
        """Run the program once per dict of arguments, concurrently (one thread per program,
        `num_threads` at a time; "auto": all of them up to 64), so the backend batches their
        calls and their shared prefixes hit the cache. States come back in input order; a
        program that failed leaves its error in its state (`state.error()`; reading raises it)."""
        backend = resolve_backend(backend)
        defaults = _sampling_defaults(max_tokens, temperature, top_p, top_k, min_p, seed)
        batch = [dict(kw) for kw in batch_kwargs]
        if not batch:
            return []
        threads = min(len(batch), MAX_THREADS) if num_threads == "auto" else int(num_threads)
        if threads < 1:
            raise ValueError(f"num_threads must be >= 1 or 'auto', got {num_threads!r}")
        states = [ProgramState(backend, defaults) for _ in batch]
        bar = _progress_bar(len(batch), progress_bar, self.fn.__name__)
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="radixserve-batch") as pool:
            futures = [pool.submit(self._run_into, state, kw) for state, kw in zip(states, batch)]
            for _ in concurrent.futures.as_completed(futures):
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return states

    def _run_into(self, state: ProgramState, kwargs: dict[str, Any]) -> None:
        try:
            state.ret_value = self.fn(state, **kwargs)
            state.sync()
        except BaseException as exc:  # kept in the state, as run_batch promises
            state._fail(exc)


def _sampling_defaults(*values: Any) -> dict[str, Any]:
    defaults = {name: value for name, value in zip(SAMPLING_DEFAULTS, values) if value is not None}
    SamplingParams(**defaults)  # validates
    return defaults


def _progress_bar(total: int, enabled: bool, name: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=name, unit="program")
