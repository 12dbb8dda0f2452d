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


def wait_healthy(url: str, process: subprocess.Popen, server_log: Callable[[], str], timeout_s: float = 180) -> None:
    """Poll GET /health until 200; fail with the server's log if it exits or never gets there."""
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
    raise AssertionError("server did not become healthy")
