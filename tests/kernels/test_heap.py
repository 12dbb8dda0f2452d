"""kernels/heap.py: freed heap goes back to the system."""

import ctypes.util

import pytest

from radixserve.kernels.heap import return_freed_memory


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon")


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library to trim")
def test_freed_heap_in_the_middle_of_the_arena_is_returned():
    blocks = [bytearray(64 * 1024) for _ in range(2000)]  # ~125 MiB of heap chunks, each touched
    for b in blocks:
        b[::4096] = b"x" * len(b[::4096])
    keep = blocks[-1]  # the heap's top stays in use: glibc cannot shrink it on free alone
    del blocks[:-1]
    before = _rss_anon_mib()
    assert return_freed_memory()
    after = _rss_anon_mib()
    assert before - after > 60, (before, after)
    assert keep[0] == ord("x")
