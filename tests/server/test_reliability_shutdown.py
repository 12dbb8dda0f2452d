"""SIGTERM with live requests: `radixserve serve` ends every stream with a final event and
`data: [DONE]`, answers a waiting non-streamed request with a 503 body, and exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from subprocess_server import free_port, wait_healthy

pytestmark = pytest.mark.real_model

NUM_STREAMS = 8
GRACE_S = 1.0
MODEL = "shutdown-test"
MAX_TOKENS = 2000  # far more than 9 requests decode in the grace on 2 cores


@pytest.mark.serial  # it times the shutdown
def test_sigterm_ends_streams_and_answers_waiting_requests(real_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "radixserve", "serve", "--model", str(real_model_dir), "--port", str(port),
        "--served-model-name", MODEL, "--num-kv-blocks", "512", "--shutdown-grace", str(GRACE_S),
        "--log-level", "info", "--enable-debug-endpoints",
    ]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(url, process, log_path.read_text)
        streams = [_Stream(url, i) for i in range(NUM_STREAMS)]
        plain = _Plain(url)
        for worker in [*streams, plain]:
            worker.thread.start()
        deadline = time.monotonic() + 40
        while not all(s.tokens > 0 for s in streams) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(s.tokens > 0 for s in streams), [s.tokens for s in streams]
        time.sleep(0.3)  # the non-streamed request is running too
        check = httpx.post(url + "/debug/check_integrity", timeout=30)
        assert check.status_code == 200, check.text
        signal_time = time.monotonic()
        process.send_signal(signal.SIGTERM)
        for worker in [*streams, plain]:
            worker.thread.join(timeout=30)
            assert not worker.thread.is_alive()
        exit_code = process.wait(timeout=30)
        shutdown_s = time.monotonic() - signal_time
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stderr = log_path.read_text()

    assert exit_code == 0, stderr[-4000:]
    assert "CancelledError" not in stderr and "Traceback" not in stderr, stderr[-4000:]
    assert "graceful shutdown exceeded" not in stderr, stderr[-4000:]
    for stream in streams:
        assert stream.error is None, (stream.index, stream.error)
        assert stream.events[-1] == "[DONE]", (stream.index, stream.events[-3:])
        final = json.loads(stream.events[-2])
        if "error" in final:
            assert final["error"]["code"] == "shutting_down" and final["error"]["type"] == "server_overloaded"
        else:
            assert final["choices"][0]["finish_reason"] in ("length", "stop")
    assert any("error" in json.loads(s.events[-2]) for s in streams), "max_tokens is too small to outlast the grace"
    assert plain.error is None, plain.error
    assert plain.status == 503 and plain.body["error"]["code"] == "shutting_down", (plain.status, plain.body)
    assert GRACE_S <= shutdown_s < 20, shutdown_s


class _Stream:
    """One streamed chat completion read to the end on its own thread."""

    def __init__(self, url: str, index: int):
        self.url = url
        self.index = index
        self.events: list[str] = []
        self.tokens = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Write a long story number {self.index}."}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=60) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    self.events.append(data)
                    if data != "[DONE]" and json.loads(data).get("choices", [{}])[0].get("delta", {}).get("content"):
                        self.tokens += 1
        except BaseException as exc:  # reported by the test
            self.error = exc


class _Plain:
    """A non-streamed completion that cannot finish before the grace ends."""

    def __init__(self, url: str):
        self.url = url
        self.status: int | None = None
        self.body: dict | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "ignore_eos": True}
        try:
            response = httpx.post(self.url + "/v1/completions", json=body, timeout=60)
            self.status = response.status_code
            self.body = response.json()
        except BaseException as exc:  # reported by the test
            self.error = exc


