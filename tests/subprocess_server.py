"""Helpers for tests that run `radixserve serve` as a real subprocess on loopback."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, server_log: Callable[[], str], timeout_s: float = 600) -> None:
    """Poll GET /health until 200; fail with the server's log if it exits or never gets there.

    The wait is long on purpose: a start that takes ~7 s warm took 52 s here on a cold page cache,
    and CI's machine is slower still; a server that truly hangs still fails, with its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited early:\n{server_log()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()  # so a log read from its pipe ends
    process.wait()
    raise AssertionError(f"server did not become healthy in {timeout_s:.0f} s:\n{server_log()[-4000:]}")
