"""Servers a bench runs and reads: a command (radixserve's, or a peer's such as llama.cpp's)
started on a free port until it answers /health and stopped with SIGINT at the end, its
resident memory, and a radixserve server's /metrics and /debug/stats read as plain dicts."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx


def radixserve_command(*extra: str) -> list[str]:
    """`radixserve serve` on this interpreter, quiet, its model served as "m"."""
    return [sys.executable, "-m", "radixserve", "serve", "--log-level", "warning", "--served-model-name", "m",
            *extra]


def keyless_env() -> dict[str, str]:
    """This environment without RADIXSERVE_API_KEY: a served radixserve takes no key."""
    return {k: v for k, v in os.environ.items() if k != "RADIXSERVE_API_KEY"}


@contextlib.contextmanager
def served(command: list[str], env: dict[str, str] | None = None, port_flag: str = "--port", **popen):
    """Run a server `command` (given `port_flag` and a free port) until it answers /health;
    yield its URL; stop it with SIGINT at the end (killed after 60 s)."""
    with served_process(command, env, port_flag, **popen) as (url, _):
        yield url


@contextlib.contextmanager
def served_process(command: list[str], env: dict[str, str] | None = None, port_flag: str = "--port", **popen):
    """As `served`, yielding (url, the server's process)."""
    port = free_port()
    command = command + [port_flag, str(port)]
    print("starting:", " ".join(command), file=sys.stderr)
    process = subprocess.Popen(command, env=env, **popen)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        yield url, process
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def serving(command: list[str]):
    """`served_process` without an API key and with the server's output kept aside: (url,
    process); the end of its log is printed if the run fails."""
    with tempfile.TemporaryFile() as log, served_process(command, keyless_env(), stdout=log,
                                                         stderr=subprocess.STDOUT) as running:
        try:
            yield running
        except BaseException:
            log.seek(0)
            print(f"{command[0]} exited {running[1].poll()}; its log ends:\n"
                  + log.read()[-3000:].decode(errors="replace"), file=sys.stderr)
            raise


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.25)
    raise SystemExit("the server did not become healthy")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resident_mib(pid: int) -> dict[str, float]:
    """A process's resident MiB now and at its peak (/proc/PID/status)."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return {"rss_mib": fields.get("VmRSS", 0.0), "peak_mib": fields.get("VmHWM", 0.0)}


def metrics(url: str) -> dict[str, float]:
    """A radixserve server's /metrics: every sample by name."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            values[sample.name] = sample.value
    return values


def debug_stats(url: str) -> dict[str, Any]:
    """A radixserve server's /debug/stats ({} where it is off or not radixserve)."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        return httpx.get(url + "/debug/stats", timeout=30).json()
    return {}
