"""Handing freed heap back to the system (glibc's malloc_trim).

Memory a step frees (a long prompt's activations, the loader's copies) goes back to the
allocator, not the system: glibc keeps it in its arenas, so a process that once computed a
2,048-token prompt stays that large. `return_freed_memory` releases every arena's free pages;
the engine loop calls it once it has been idle for a while after working, the loader after
loading. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


def return_freed_memory() -> bool:
    """Release the free pages of every malloc arena; False where there is no malloc_trim."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
