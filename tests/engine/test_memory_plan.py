"""The KV memory planner (engine/memory_plan.py): a byte budget split among the kinds of KV
state a model needs, with exact byte figures."""

import pytest
import torch

from radixserve.config import EngineConfig
from radixserve.engine.memory_plan import Share, plan_memory, split_budget
from radixserve.model.spec import ModelSpec


def _spec(layer_windows=()):
    return ModelSpec(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=1024,
                     tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                     hidden_act="silu", hf_config=None, layer_windows=layer_windows)


def _plan(hybrid, **options):
    cfg = EngineConfig(**{"block_size": 16, "kv_cache_memory": 1_000_000, **options})
    spec = _spec((32, 32, 32, 0) if hybrid else ())
    return plan_memory(cfg, spec, torch.float32, torch.device("cpu"), hybrid)


def test_a_full_attention_model_gets_whole_blocks_of_every_layer():
    # a layer's block: K and V, 16 tokens, 2 heads of 16 floats = 4096 bytes; 4 layers 16384
    plan = _plan(hybrid=False)
    assert plan.shares == {"full": Share(61, 16384)}  # 61 * 16384 = 999424 <= 1,000,000 < 62 * 16384
    assert plan.num_blocks == 61 and plan.num_window_pages == 0 and plan.budget == 1_000_000


def test_a_hybrid_window_model_splits_blocks_and_window_pages_by_the_ratio():
    # one full layer (4096 bytes a block), three window layers (12288 bytes a page), 0.25 pages a block:
    # 1,000,000 // (4096 + 0.25 * 12288) = 139 blocks, 34 pages (the least: (32 + 64) / 16 + 2 = 8)
    plan = _plan(hybrid=True, chunked_prefill_size=64)
    assert plan.shares == {"full": Share(139, 4096), "window": Share(34, 12288)}
    assert sum(s.bytes for s in plan.shares.values()) == 569344 + 417792 <= 1_000_000
    assert plan.window == 32 and plan.window_ratio == 34 / 139


def test_a_hybrid_model_gets_one_requests_window_first():
    # the least pages, (32 + 512) / 16 + 2 = 36, come first; blocks in the rest: (1e6 - 36 * 12288) // 4096
    plan = _plan(hybrid=True)
    assert plan.shares == {"full": Share(136, 4096), "window": Share(36, 12288)}


def test_given_blocks_are_not_split_and_too_small_a_budget_is_refused():
    assert split_budget(None, 4096, 4, num_blocks=10).shares == {"full": Share(10, 16384)}
    assert split_budget(None, 4096, 4, 3, 32, 8, 0.25, num_blocks=100).shares == {
        "full": Share(100, 4096), "window": Share(25, 12288)}
    with pytest.raises(ValueError, match="holds no KV block"):
        split_budget(16383, 4096, 4)
    with pytest.raises(ValueError, match="less than one request's window"):
        split_budget(8 * 12288, 4096, 4, 3, 32, 9, 0.25)


def test_a_recurrent_model_gives_its_state_snapshots_a_quarter_of_the_budget_first():
    # one snapshot 5,000 bytes: 250,000 // 5,000 = 50 snapshots (250,000 bytes), blocks in the 750,000 left
    cfg = EngineConfig(block_size=16, kv_cache_memory=1_000_000)
    plan = plan_memory(cfg, _spec(), torch.float32, torch.device("cpu"), False, snapshot_bytes=5_000)
    assert plan.shares == {"full": Share(45, 16384), "recurrent": Share(50, 5_000)}  # 45 * 16384 = 737,280
    assert plan.num_snapshots == 50 and plan.budget == 1_000_000
    given = EngineConfig(block_size=16, num_kv_blocks=256)  # blocks given: one snapshot per 8 (at least 16)
    plan = plan_memory(given, _spec(), torch.float32, torch.device("cpu"), False, snapshot_bytes=5_000)
    assert plan.shares == {"full": Share(256, 16384), "recurrent": Share(32, 5_000)}
    small = EngineConfig(block_size=16, num_kv_blocks=40)
    assert plan_memory(small, _spec(), torch.float32, torch.device("cpu"), False, snapshot_bytes=5_000).num_snapshots == 16
    # large states: no more bytes than a quarter of blocks and snapshots together (1024 * 16384 / 3 // 200,000 = 27,
    # not 1024 // 8 = 128: 25.6 MB of snapshots beside 16.8 MB of blocks)
    large = EngineConfig(block_size=16, num_kv_blocks=1024)
    assert plan_memory(large, _spec(), torch.float32, torch.device("cpu"), False, snapshot_bytes=200_000).shares == {
        "full": Share(1024, 16384), "recurrent": Share(27, 200_000)}
    assert plan_memory(small, _spec(), torch.float32, torch.device("cpu"), False,
                       snapshot_bytes=200_000).num_snapshots == 16  # never fewer than 16


def test_a_budget_whose_share_keeps_no_snapshot_is_refused_naming_the_least():
    # a match would adopt cached blocks with no state to resume from
    cfg = EngineConfig(block_size=16, kv_cache_memory=1_000_000)
    with pytest.raises(ValueError, match="keeps no recurrent-state snapshot.*at least 1200000 bytes"):
        plan_memory(cfg, _spec(), torch.float32, torch.device("cpu"), False, snapshot_bytes=300_000)
    enough = EngineConfig(block_size=16, kv_cache_memory=1_200_000)
    assert plan_memory(enough, _spec(), torch.float32, torch.device("cpu"), False,
                       snapshot_bytes=300_000).num_snapshots == 1
