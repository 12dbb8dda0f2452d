from types import SimpleNamespace

from radixserve.execution.runner import _batch_order, _extend_slots
from radixserve.core.plan import ScheduledChunk


def test_slots_follow_the_block_table_across_block_boundaries():
    slots: list[int] = []
    _extend_slots(slots, [7, 2, 9], start=3, end=10, block_size=4)
    # positions 3 | 4 5 6 7 | 8 9  ->  block 7 slot 3 | block 2 slots 0-3 | block 9 slots 0-1
    assert slots == [31, 8, 9, 10, 11, 36, 37]
    _extend_slots(slots, [5], start=0, end=0, block_size=4)
    assert len(slots) == 7


def test_batch_puts_decodes_first_with_prefix_sharers_side_by_side():
    def chunk(name, table, num_tokens):
        return ScheduledChunk(SimpleNamespace(name=name, block_table=table), 0, num_tokens)

    chunks = [
        chunk("prefill", [1, 2], 40),
        chunk("a1", [5, 6, 9], 1),
        chunk("b1", [3, 4, 8], 1),
        chunk("a2", [5, 6, 7], 1),
        chunk("b2", [3, 4], 1),
        chunk("lone", [11], 1),
    ]
    order = [c.request.name for c in sorted(chunks, key=_batch_order)]
    assert order == ["b2", "b1", "a2", "a1", "lone", "prefill"]


def test_runner_config_is_made_from_the_engine_config_in_one_place():
    import torch

    from radixserve.attention.backend import AttentionOptions
    from radixserve.config import EngineConfig
    from radixserve.execution.runner_config import RunnerConfig

    cfg = EngineConfig(block_size=8, seed=5, kv_cache_dtype="int8", native_decoder=False, onednn_linear=False,
                       tiled_prefill_attention=False)
    config = RunnerConfig.from_engine(cfg, num_blocks=32, backend="torch", device=torch.device("cpu"),
                                      dtype=torch.float32)
    assert (config.num_blocks, config.block_size, config.backend, config.seed) == (32, 8, "torch", 5)
    assert (config.kv_cache_dtype, config.native_decoder, config.onednn_linear) == ("int8", False, False)
    assert config.attention == AttentionOptions(tiled_prefill=False, prefill_dtype="float32")


def test_a_backend_configures_itself_and_refuses_what_it_would_not_read():
    import pytest

    from radixserve.attention.backend import AttentionOptions
    from radixserve.attention.torch_backend import TorchAttentionBackend

    backend = TorchAttentionBackend(4, 2, 16, 0.25)
    backend.configure(AttentionOptions(tiled_prefill=False))  # not its option: nothing to honour
    assert not backend.hosts_native_decoder
    with pytest.raises(ValueError, match="read by the cpu attention backend only; this engine runs torch"):
        backend.configure(AttentionOptions(prefill_dtype="bfloat16"))


def test_the_cpu_backend_reads_its_options():
    import pytest

    from radixserve.attention.backend import AttentionOptions
    from radixserve.kernels.native_attention import load_native_attention

    if load_native_attention() is None:
        pytest.skip("no C compiler here")
    from radixserve.attention.cpu_backend import CpuAttentionBackend

    backend = CpuAttentionBackend(4, 2, 16, 0.25)
    assert backend.tiled_prefill and backend.hosts_native_decoder
    backend.configure(AttentionOptions(tiled_prefill=False))
    assert not backend.tiled_prefill and not backend.bf16_prefill
    with pytest.raises(ValueError, match="tiled prompt kernel"):
        backend.configure(AttentionOptions(tiled_prefill=False, prefill_dtype="bfloat16"))
