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


_THREADS_ALLOCATE = """
import ctypes, ctypes.util, re, sys, threading
from radixserve.kernels.heap import use_one_arena
if sys.argv[1] == "one":
    assert use_one_arena()
def allocate():
    blocks = [bytearray(200_000) for _ in range(50)] + [bytearray(100) for _ in range(1000)]
    del blocks
threads = [threading.Thread(target=allocate) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.open_memstream.restype = ctypes.c_void_p
buf, size = ctypes.c_char_p(), ctypes.c_size_t()
stream = ctypes.c_void_p(libc.open_memstream(ctypes.byref(buf), ctypes.byref(size)))
libc.malloc_info(0, stream)
libc.fclose(stream)
print(len(re.findall('<heap nr=', ctypes.string_at(buf, size.value).decode())))
"""


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library")
@pytest.mark.parametrize("arenas, at_most", [("one", 1), ("default", None)])
def test_threads_allocate_from_the_main_arena_once_limited_to_one(arenas, at_most):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _THREADS_ALLOCATE, arenas], capture_output=True, text=True,
                         check=True, timeout=120)
    heaps = int(out.stdout.strip().splitlines()[-1])
    assert heaps == 1 if at_most == 1 else heaps > 1, out.stdout


def test_serve_limits_the_arenas_before_anything_else(monkeypatch):
    import radixserve.kernels.heap as heap
    import radixserve.server.launch as launch
    from radixserve.__main__ import main

    calls: list[str] = []
    monkeypatch.setattr(heap, "use_one_arena", lambda: calls.append("one arena") or True)
    monkeypatch.setattr(launch, "serve", lambda args, engine: calls.append("serve") or 0)
    assert main(["serve"]) == 0
    assert calls == ["one arena", "serve"]


def test_registered_scratch_is_let_go_before_each_trim(monkeypatch):
    import radixserve.kernels.heap as heap

    released: list[str] = []
    monkeypatch.setattr(heap, "_RELEASERS", [])
    heap.on_trim(lambda: released.append("scratch"))
    heap.return_freed_memory()
    heap.return_freed_memory()
    assert released == ["scratch", "scratch"]
