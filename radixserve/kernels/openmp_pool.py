"""release_thread_pool: let the calling thread's OpenMP worker threads go.

torch's parallel ops and the C kernels share one OpenMP runtime (the libgomp torch loads,
native_build.py), which keeps a pool of worker threads for every thread that has started a
parallel region. Once the process holds more of those threads than there are cores,
libgomp's workers stop spinning between regions and sleep on a futex after ~1,000 spins, so
every region of a step (hundreds) starts with a wake-up. An engine built on one thread and
stepped on another (EngineLoop: the server, the DSL) has two pools, and on 2 cores its
decode steps took 1.3-1.5x as long, with ~300 voluntary context switches a step instead of
none. A thread that hands its parallel work to another releases its pool here; a later
parallel region on it builds a new one.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger(__name__)

_RUNTIMES = ("libgomp.so.1", "libomp.so", "libomp.dylib", "libiomp5.so")  # as torch builds load them
_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what a restart needs


@functools.cache
def _pause_call():
    """The loaded OpenMP runtime's omp_pause_resource_all, or None (none loaded, or too old)."""
    import torch  # noqa: F401  (the runtime torch brings is the one to find)

    for name in _RUNTIMES:
        try:
            runtime = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)  # never a second copy
        except (OSError, AttributeError):
            continue
        call = getattr(runtime, "omp_pause_resource_all", None)
        if call is not None:
            call.argtypes, call.restype = [ctypes.c_int], ctypes.c_int
            return call
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (not inside a parallel region: OpenMP
    refuses then); True when the runtime did. Other threads' pools are not touched."""
    call = _pause_call()
    if call is None:
        return False
    ok = call(_OMP_PAUSE_SOFT) == 0
    if not ok:
        log.debug("omp_pause_resource_all refused on this thread")
    return ok
