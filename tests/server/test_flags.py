"""Every `radixserve serve` flag either changes what the server reports (`/get_server_info`:
the engine config and the server options) or is refused at start with a clear message
(issue 29, point 2): an option that silently does nothing changes a deployment's meaning."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from radixserve import Engine
from radixserve.__main__ import add_engine_args, engine_kwargs
from radixserve.config import EngineConfig
from radixserve.cluster.launch import add_cluster_args, refuse_cluster_flags_alone
from radixserve.server.launch import add_server_args, server_options
from tiny_models import build_tiny_model

# Flags whose effect is not a reported setting, with where it is tested instead.
NOT_REPORTED = {
    "--host": "the address uvicorn binds (test_server_cli)",
    "--port": "the port uvicorn binds (test_server_cli)",
    "--log-level": "the logging level",
    "--replicas": "starts the cluster mode instead of one server (test_cluster_ray)",
    "--ray-address": "starts the cluster mode instead of one server (test_cluster_ray)",
    "--api-key-file": "read into the keys, reported as their count (test_server_cli)",
}
# Flags that only make sense beside another one: (the flag's value, what it needs).
NEEDS = {
    "--ttft-target-ms": ["--max-step-ms", "100"],
    "--num-speculative-tokens": ["--speculative", "prompt-lookup"],
    "--prompt-lookup-max": ["--speculative", "prompt-lookup"],
    "--prompt-lookup-min": ["--speculative", "prompt-lookup", "--prompt-lookup-max", "5"],
    "--speculative-max-batch": ["--speculative", "prompt-lookup"],
    "--no-speculative-adaptive": ["--speculative", "prompt-lookup"],
    "--speculative-tree-width": ["--speculative", "suffix"],
    "--shared-cache-across-keys": ["--api-key", "k"],
    "--router": ["--replicas", "2"],
    "--balance-threshold": ["--replicas", "2"],
    "--replica-cpus": ["--replicas", "2"],
    "--transfer-timeout": ["--prefill-replicas", "1", "--decode-replicas", "1"],
    "--local-prefill-tokens": ["--prefill-replicas", "1", "--decode-replicas", "1"],
    "--prefill-backlog-tokens": ["--prefill-replicas", "1", "--decode-replicas", "1"],
    "--prefill-resource": ["--prefill-replicas", "1", "--decode-replicas", "1"],
    "--decode-resource": ["--prefill-replicas", "1", "--decode-replicas", "1"],
    "--kv-events-replay-endpoint": ["--kv-events-endpoint", "tcp://127.0.0.1:5557"],
    "--kv-events-hash": ["--kv-events-endpoint", "tcp://127.0.0.1:5557"],
    "--kv-events-format": ["--kv-events-endpoint", "tcp://127.0.0.1:5557"],
}
VALUES = {"--device": "cpu", "--speculative": "prompt-lookup", "--kv-events-endpoint": "tcp://127.0.0.1:5557",
          "--kv-events-replay-endpoint": "tcp://127.0.0.1:5558", "--window-pages-ratio": "0.5",
          "--chat-template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
REFUSED_ALONE = {
    "--kv-events-replay-endpoint": "set it too",
    "--kv-events-hash": "set it too",
    "--kv-events-format": "set it too",
    "--ttft-target-ms": "max_step_ms",
    "--num-speculative-tokens": "speculative",
    "--prompt-lookup-max": "speculative",
    "--prompt-lookup-min": "speculative",
    "--speculative-max-batch": "speculative",
    "--no-speculative-adaptive": "speculative",
    "--speculative-tree-width": "speculative",
    "--shared-cache-across-keys": "needs API keys",
    "--router": "--replicas",
    "--balance-threshold": "--replicas",
    "--replica-cpus": "--replicas",
    "--transfer-timeout": "--replicas",
    "--local-prefill-tokens": "--replicas",
    "--prefill-backlog-tokens": "--replicas",
    "--prefill-resource": "--replicas",
    "--decode-resource": "--replicas",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_server_args(parser)
    add_cluster_args(parser)
    add_engine_args(parser)
    return parser


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _probe(action: argparse.Action, tmp_path) -> list[str]:
    """The flag with a valid value other than its default."""
    flag = next(s for s in action.option_strings if not s.startswith("--no-"))
    if isinstance(action, argparse.BooleanOptionalAction):
        return ["--no-" + flag[2:]] if action.default else [flag]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, next(str(c) for c in action.choices if c != action.default)]
    if flag in VALUES:
        return [flag, VALUES[flag]]
    if flag in ("--step-trace",):
        return [flag, str(tmp_path / "trace.jsonl")]
    if flag.endswith("-dir") or flag in ("--model",):
        return [flag, str(tmp_path / flag[2:])]
    if action.type is int:
        return [flag, str((action.default or 0) + 1 if flag != "--kv-cache-memory" else 1 << 30)]
    if action.type is float:
        return [flag, str((action.default or 0) + 1.5)]
    return [flag, "some-value"]


def _settle(argv: list[str]) -> dict:
    """What /get_server_info would report for these flags, or ValueError as at start."""
    args = _parser().parse_args(argv)
    options = server_options(args)
    refuse_cluster_flags_alone(args)
    return {"engine": dataclasses.asdict(EngineConfig(**engine_kwargs(args))), "server": options.reported(),
            "cluster": {name: getattr(args, name) for name in ("replicas", "router", "balance_threshold",
                                                                "replica_cpus", "prefill_replicas", "decode_replicas",
                                                                "transfer_timeout", "local_prefill_tokens", "prefill_backlog_tokens",
                                                                "prefill_resource", "decode_resource")}}


def test_every_flag_changes_a_reported_setting_or_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("RADIXSERVE_API_KEY", raising=False)
    defaults = _settle([])
    flags = _flags(_parser())
    names = {s for a in flags for s in a.option_strings}
    assert set(NOT_REPORTED) <= names and set(NEEDS) <= names  # the lists name real flags
    checked = []
    for action in flags:
        probe = _probe(action, tmp_path)
        if probe[0] in NOT_REPORTED:
            continue
        if probe[0] in REFUSED_ALONE:
            with pytest.raises(ValueError, match=REFUSED_ALONE[probe[0]]):
                _settle(probe)
            base = _settle(NEEDS[probe[0]])
            assert _settle(NEEDS[probe[0]] + probe) != base, probe
        else:
            assert _settle(probe) != defaults, f"{probe} changes nothing that is reported"
        checked.append(probe[0])
    assert len(checked) >= 40


@pytest.mark.parametrize("argv, message", [
    (["--no-enable-prefix-cache", "--kv-offload-memory", "1000000"], "need the prefix cache"),
    (["--no-enable-prefix-cache", "--kv-persist-dir", "/tmp/x"], "need the prefix cache"),
    (["--no-enable-prefix-cache", "--session-ttl-s", "5"], "need the prefix cache"),
    (["--no-enable-prefix-cache", "--schedule-policy", "dfs-weight"], "needs the prefix cache"),
    (["--schedule-policy", "fcfs", "--policy-fcfs-threshold", "9"], "cache-aware policies"),
    (["--model", "/m", "--model-cache-dir", "/c"], "does nothing with a model directory"),
])
def test_options_that_would_do_nothing_together_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        _settle(argv)


def test_kv_offload_dir_alone_gets_a_default_tier_and_says_so(tiny_model_dir, tmp_path, caplog):
    """It used to start with no tier at all, silently."""
    with caplog.at_level(logging.INFO, logger="radixserve.tiering"):
        engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=32, kv_offload_dir=str(tmp_path))
    stats = engine.stats()
    per_block = engine.tiering.store.slot_bytes
    assert stats["tier_blocks_total"] == (2 << 30) // per_block
    assert any("default 2.00 GiB" in r.getMessage() for r in caplog.records)
    assert (engine.tiering.store.path or "").startswith(str(tmp_path))
    engine.close()
    plain = Engine(str(tiny_model_dir("llama")), num_kv_blocks=32)
    assert "tier_blocks_total" not in plain.stats()
