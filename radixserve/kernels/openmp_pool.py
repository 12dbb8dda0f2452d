"""release_thread_pool: let the calling thread's OpenMP worker threads go.

torch's parallel ops and the C kernels share one OpenMP runtime (the libgomp torch loads,
native_build.py), which keeps a pool of worker threads for every thread that has started a
parallel region. Once the process holds more of those threads than there are cores,
libgomp's workers spin only briefly between regions and then sleep on a futex
(GOMP_SPINCOUNT does not change that), so every region of a step (hundreds) starts with a
wake-up. An engine built on one thread and stepped on another (EngineLoop: the server, the
DSL) has two pools, and on 2 cores its decode steps took 1.3-1.5x as long, with ~300
voluntary context switches a step instead of none. A thread that hands its parallel work to
another releases its pool here; a later parallel region on it builds a new one. Only
libgomp (torch's Linux wheels) is handled: its omp_pause_resource_all frees the calling
thread's pool alone, so it is safe while another thread is inside a region; other runtimes
are left as they are.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger(__name__)

_LIBGOMP = "libgomp.so.1"  # the name torch's copy answers to once loaded (native_build.py)
_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what a restart needs


@functools.cache
def _pause_call():
    """The loaded libgomp's omp_pause_resource_all, or None (not loaded, or too old: GCC < 9)."""
    import torch  # noqa: F401  (the runtime torch brings is the one to find)

    try:
        runtime = ctypes.CDLL(_LIBGOMP, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)  # never a second copy
    except (OSError, AttributeError):  # another runtime (or none); RTLD_NOLOAD is POSIX-only
        return None
    call = getattr(runtime, "omp_pause_resource_all", None)
    if call is not None:
        call.argtypes, call.restype = [ctypes.c_int], ctypes.c_int
    return call


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (not inside a parallel region: libgomp
    refuses then); True when it did. Other threads' pools are not touched; False, and nothing
    done, where the runtime is not libgomp."""
    call = _pause_call()
    if call is None:
        return False
    ok = call(_OMP_PAUSE_SOFT) == 0
    if not ok:
        log.debug("omp_pause_resource_all refused on this thread")
    return ok


@functools.cache
def _team_calls():
    """The loaded libgomp's (omp_set_num_threads, omp_get_max_threads), or None."""
    import torch  # noqa: F401  (the runtime torch brings is the one to find)

    try:
        runtime = ctypes.CDLL(_LIBGOMP, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
    except (OSError, AttributeError):
        return None
    set_call, get_call = getattr(runtime, "omp_set_num_threads", None), getattr(runtime, "omp_get_max_threads", None)
    if set_call is None or get_call is None:
        return None
    set_call.argtypes, set_call.restype = [ctypes.c_int], None
    get_call.argtypes, get_call.restype = [], ctypes.c_int
    return set_call, get_call


def team_size() -> int:
    """The calling thread's team size for its next parallel region."""
    calls = _team_calls()
    if calls is not None:
        return int(calls[1]())
    import torch

    return torch.get_num_threads()


def set_team_size(threads: int) -> None:
    """The team size of the calling thread's next parallel regions: torch's ops and the C
    kernels alike (both read libgomp's per-thread setting). libgomp's own call costs
    microseconds; torch.set_num_threads, the fallback for other runtimes, milliseconds (it
    rebuilds torch's other pools), so a caller changes it only when the count changes."""
    calls = _team_calls()
    if calls is not None:
        calls[0](int(threads))
        return
    import torch

    torch.set_num_threads(int(threads))
