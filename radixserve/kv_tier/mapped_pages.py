"""MappedPages: page-level calls on a memory mapping through libc (Linux): which pages are
in memory (mincore), fault a range in for reading or writing ahead of use (madvise
WILLNEED, MADV_POPULATE_READ / MADV_POPULATE_WRITE), and write a range back (msync).

They exist so that a background thread can wait on the disk for the engine thread. Every
call goes through ctypes, which releases the GIL for the call: a thread blocked here never
stalls the engine thread's Python. (mmap.mmap.flush holds the GIL through its msync:
measured, a 100 ms flush on a writer thread was a 100 ms stall of every other thread.)

None of these calls changes the bytes of the mapping. Elsewhere than Linux, or where libc
cannot be loaded, `available` is False and callers do without.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys

log = logging.getLogger("radixserve.mapped_pages")

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_WILLNEED = 3
_MADV_POPULATE_READ = 22  # Linux 5.14+
_MADV_POPULATE_WRITE = 23
_MS_SYNC = 4
_LOW_BIT = bytes(i & 1 for i in range(256))


def page_span(addr: int, length: int) -> tuple[int, int]:
    """The page-aligned range (start, length) that covers [addr, addr + length)."""
    start = addr - addr % PAGE
    end = addr + length
    return start, -(-(end - start) // PAGE) * PAGE


class MappedPages:
    def __init__(self) -> None:
        self.available = False
        self.populate_ok = True  # cleared when the kernel refuses MADV_POPULATE_* (before 5.14)
        if not sys.platform.startswith("linux"):
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            for name in ("mincore", "madvise", "msync"):
                getattr(libc, name).restype = ctypes.c_int
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError) as exc:
            log.info("page calls unavailable (%s): tier pages are not prefetched", exc)
            return
        self._libc = libc
        self.available = True

    def missing_pages(self, addr: int, length: int) -> int:
        """How many pages of [addr, addr + length) are not in memory (page cache or RAM)."""
        start, span = page_span(addr, length)
        vec = (ctypes.c_ubyte * (span // PAGE))()
        if self._libc.mincore(start, span, vec) != 0:
            raise _error("mincore")
        return bytes(vec).translate(_LOW_BIT).count(0)  # bit 0: resident; the rest is reserved

    def populate(self, addr: int, length: int, write: bool) -> bool:
        """Fault the range in (reading it from disk if need be), for reading or for writing;
        False where the kernel has no MADV_POPULATE_* (nothing done)."""
        if not self.populate_ok:
            return False
        start, span = page_span(addr, length)
        if self._libc.madvise(start, span, _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EINVAL:
            self.populate_ok = False
            log.info("MADV_POPULATE_* not supported by this kernel: tier pages are read with pread instead")
            return False
        raise OSError(err, f"madvise(POPULATE): {os.strerror(err)}")

    def will_need(self, addr: int, length: int) -> None:
        """Start reading the range from disk (asynchronous readahead); returns at once."""
        start, span = page_span(addr, length)
        self._libc.madvise(start, span, _MADV_WILLNEED)  # a hint: its failure changes nothing

    def sync(self, addr: int, length: int) -> None:
        """Write the range's dirty pages to disk and wait for them (msync MS_SYNC)."""
        start, span = page_span(addr, length)
        if self._libc.msync(start, span, _MS_SYNC) != 0:
            raise _error("msync")


def _error(call: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{call}: {os.strerror(err)}")
