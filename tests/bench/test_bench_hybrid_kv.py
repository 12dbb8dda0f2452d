"""bench_hybrid_kv's memory part in its smallest form, on the tiny Gemma 3 (two window layers of
6 tokens, one full layer): a conversation whose follow-ups hit the cache exactly as with every
layer kept, and the bytes it accounts are the blocks held plus the window pages the prompt and reply ends keep."""

from __future__ import annotations

from bench.bench_hybrid_kv import BLOCK_SIZE, Conversation, measure_memory


def test_memory_part_on_tiny_gemma3(tiny_model_dir):
    # node ends at 32, 64 and 96 tokens (each turn's computed tokens, cut to whole blocks)
    conversation = Conversation(turns=3, system=40, step=24, answer=4)
    report = measure_memory(conversation, 1 << 20, progress=False, model=str(tiny_model_dir("gemma3")))
    hybrid, full = report["systems"]
    assert report["follow_up_cached_equal"] and report["answers_equal"]
    assert hybrid["turn_cached_tokens"] == [0, 32, 64]  # a hit up to the previous turn's last whole block
    assert hybrid["cached_tokens"] == full["cached_tokens"] == 96
    assert hybrid["blocks_held"] == full["blocks_held"] == 96 // BLOCK_SIZE
    assert hybrid["cache_nodes"] == 3
    # every prompt end and every reply end keeps the window of each point up to the slack (one
    # block here) before it (core/window_pages.py): with 6-token windows and three turns of two
    # ends each, all six blocks keep their window page, so this tiny conversation saves nothing
    assert hybrid["window_pages_attached"] == 6
    layer_token = full["block_bytes"] // (3 * BLOCK_SIZE)  # the tiny model: 3 layers
    assert hybrid["block_bytes"] == layer_token * BLOCK_SIZE
    assert hybrid["window_page_bytes"] == 2 * hybrid["block_bytes"]
    assert hybrid["bytes_per_cached_token"] == (6 * hybrid["block_bytes"] + 6 * hybrid["window_page_bytes"]) / 96
    assert report["bytes_per_cached_token_ratio"] == (6 + 12) / (6 * 3)
    assert report["tokens_fit_ratio"] > 1.5  # 1 + 2 * 0.25 layers a block against 3


def test_the_swarm_takes_the_default_model_and_skips_what_needs_window_layers(real_model_dir, capsys):
    """--model default: SmolLM2's KV shape, its own Q4_1 GGUF for llama.cpp, and no hybrid or
    --swa-full systems (no window layers), refused before any server starts."""
    import argparse
    from pathlib import Path

    from bench.lib.swarm import AgentSwarm
    from bench.bench_hybrid_kv import measure_swarm, model_geometry

    geometry = model_geometry("default")
    assert (geometry.layers, geometry.window_layers, geometry.kv_heads, geometry.head_dim) == (30, 0, 3, 64)
    assert geometry.vocab_size == 49152 and geometry.token_layer_bytes_f32 == 2 * 3 * 64 * 4
    assert Path(geometry.gguf).name.endswith(".Q4_1.gguf") and Path(geometry.gguf).is_file()
    args = argparse.Namespace(max_num_seqs=8, hybrid_memory_share=0.4, window_pages_ratio=None, quiet=True,
                              llama_server="/nonexistent", llama_threads=2)
    report = measure_swarm(AgentSwarm(agents=2, turns=1, tool_prompt=64, instructions=16, tool_result=16, answer=4, latency=(0.0, 0.1)), ["hybrid", "hybrid-same", "llama-swa-full"], args, geometry)
    assert report["systems"] == [] and report["model"] == "default"
    assert capsys.readouterr().out.count("has no sliding-window layers") == 3


def test_serve_args_reach_every_radixserve_server(monkeypatch, capsys):
    """--serve-args (e.g. a step trace) is split like a shell line and appended to the command
    of the radixserve server the swarm starts."""
    import bench.bench_hybrid_kv as bench
    from bench.lib.swarm import AgentSwarm

    commands = []

    class Started(Exception):
        pass

    def served(command, log):
        commands.append(command)
        raise Started

    monkeypatch.setattr(bench, "_served", served)
    workload = AgentSwarm(agents=1, turns=1, tool_prompt=16, instructions=4, tool_result=4, answer=2, latency=(0.0, 0.0))
    for hybrid in (True, False):
        try:
            bench.run_radixserve("x", workload, 1 << 20, hybrid, 2, False, 0.5, bench.model_geometry("gemma3-270m"),
                                 serve_args="--step-trace '/tmp/a b.jsonl' --max-step-ms 50")
        except Started:
            pass
    assert [c[-4:] for c in commands] == [["--step-trace", "/tmp/a b.jsonl", "--max-step-ms", "50"]] * 2
    assert "--window-pages-ratio" in commands[0] and "--window-pages-ratio" not in commands[1]
