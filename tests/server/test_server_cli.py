"""`radixserve serve` as a real subprocess: flags, API key from the environment, SIGINT."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from radixserve.server.launch import add_server_args, server_options
from subprocess_server import free_port, wait_healthy

pytestmark = pytest.mark.real_model


def test_defaults_bind_loopback_and_read_the_key_from_the_environment(monkeypatch):
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parser.parse_args([])
    assert args.host == "127.0.0.1" and args.port == 30000
    monkeypatch.setenv("RADIXSERVE_API_KEY", "from-env")
    assert server_options(args).all_api_keys == ("from-env",)
    assert server_options(parser.parse_args(["--api-key", "flag"])).all_api_keys == ("flag",)
    monkeypatch.delenv("RADIXSERVE_API_KEY")
    assert server_options(args).all_api_keys == ()
    assert not server_options(args).shared_cache_across_keys


def test_several_keys_from_flags_and_a_file(tmp_path):
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# tenants\nkey-c\n\n  key-d  \nkey-a\n")
    args = parser.parse_args(["--api-key", "key-a", "--api-key", "key-b", "--api-key-file", str(key_file),
                              "--shared-cache-across-keys"])
    options = server_options(args)
    assert options.all_api_keys == ("key-a", "key-b", "key-c", "key-d")
    assert options.shared_cache_across_keys
    key_file.write_text("# nothing here\n")
    with pytest.raises(ValueError, match="holds no keys"):
        server_options(parser.parse_args(["--api-key-file", str(key_file)]))


@pytest.mark.parametrize("stop_signal", [signal.SIGINT])
def test_serve_subprocess_answers_and_stops_on_signal(real_model_dir, stop_signal):
    port = free_port()
    env = dict(os.environ, RADIXSERVE_API_KEY="sekret")
    command = [
        sys.executable, "-m", "radixserve", "serve", "--model", str(real_model_dir), "--port", str(port),
        "--num-kv-blocks", "256", "--log-level", "warning",
    ]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process, process.stdout.read)
        client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0, timeout=60)
        out = client.chat.completions.create(
            model=str(real_model_dir), messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
        )
        assert out.model == "SmolLM2-135M-Instruct" and out.usage.completion_tokens <= 3
        assert httpx.get(url + "/v1/models").status_code == 401
        process.send_signal(stop_signal)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        output = process.stdout.read()
    assert "serving SmolLM2-135M-Instruct" in output
    assert "Traceback" not in output




def test_engine_flags_with_a_fixed_set_of_values_refuse_others():
    from radixserve.__main__ import add_engine_args
    from radixserve.config import SPECULATIVE_METHODS

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--speculative", SPECULATIVE_METHODS[0]]).speculative == SPECULATIVE_METHODS[0]
    for flag, value in (("--speculative", "bogus"), ("--attention-backend", "cuda"), ("--schedule-policy", "lru")):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, value])
