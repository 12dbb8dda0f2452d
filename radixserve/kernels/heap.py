"""Handing freed heap back to the system (glibc's malloc_trim).

Memory a step frees (a long prompt's activations, the loader's copies) goes back to the
allocator, not the system: glibc keeps it in its arenas, so a process that once computed a
2,048-token prompt stays that large. `return_freed_memory` releases every arena's free pages;
the engine loop calls it once it has been idle for a while after working, the loader after
loading. Elsewhere than glibc it does nothing.

malloc_trim shrinks only the main arena's top: a thread's own arena keeps its top chunk (up
to the trim threshold, which glibc raises to twice the largest mmapped chunk freed: tens of MiB
once a long prompt's activations were). `use_one_arena` makes every thread allocate from the main arena,
so the engine thread's steps free into memory that a trim returns; `radixserve serve` calls it
before its first thread starts (the server's allocating threads mostly hold the GIL anyway).
Scratch kept between calls for speed (model/layers.py's dequantization buffer) registers with
`on_trim` and is let go at each trim: an idle engine holds none of it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

M_ARENA_MAX = -8  # glibc's mallopt parameter: the most arenas threads may allocate from
_RELEASERS: list[Callable[[], None]] = []  # on_trim's, called by return_freed_memory


def use_one_arena() -> bool:
    """Threads created from now on allocate from the main arena (glibc's M_ARENA_MAX = 1);
    False where there is no mallopt. Call before any second thread has allocated: glibc
    keeps an arena it has given a thread, and hands existing ones to new threads."""
    mallopt = _libc("mallopt")
    return mallopt is not None and mallopt(M_ARENA_MAX, 1) == 1


def on_trim(release: Callable[[], None]) -> Callable[[], None]:
    """Call `release` (on the trimming thread) at each return_freed_memory, before the trim."""
    _RELEASERS.append(release)
    return release


def return_freed_memory() -> bool:
    """Let the calling thread's registered scratch go (on_trim), then release the free pages of
    every malloc arena; False where there is no malloc_trim."""
    for release in _RELEASERS:
        release()
    trim = _libc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _libc(function: str) -> Callable[..., int] | None:
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function) if name else None
    except (OSError, AttributeError):
        return None
