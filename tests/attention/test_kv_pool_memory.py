"""The KV pool's memory: committed as blocks are first written, or all at start with
`prefault_kv_pool` (what `radixserve serve` does, so a server's resident memory does not
grow into its KV budget while it serves)."""

from __future__ import annotations

import torch

from radixserve import Engine
from radixserve.__main__ import build_parser
from radixserve.attention.kv_pool import KVPool


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Rss of the mapping that holds `tensor` (this process's /proc/self/smaps)."""
    address, inside = tensor.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the pool")


def _pool(prefault: bool) -> KVPool:
    return KVPool(4, 256, 16, 2, 64, torch.float32, torch.device("cpu"), prefault=prefault)  # 16 MiB


def test_a_prefaulted_pool_is_resident_from_the_start_and_zero():
    pool = _pool(prefault=True)
    size = pool.kv.numel() * pool.kv.element_size()
    assert size == 16 << 20
    assert _resident_bytes(pool.kv) >= size
    assert not pool.kv.any()


def test_a_lazy_pool_commits_only_the_blocks_written():
    pool = _pool(prefault=False)
    assert _resident_bytes(pool.kv) == 0
    pool.kv[:, :, 0] = 1.0  # block 0 of every layer: 8 slices of 8 KiB
    assert 0 < _resident_bytes(pool.kv) <= 8 * 8192 + (2 << 20)


def test_serve_prefaults_and_the_library_does_not(tiny_model_dir):
    parser = build_parser()
    assert parser.parse_args(["serve"]).prefault_kv_pool is True
    assert parser.parse_args(["serve", "--no-prefault-kv-pool"]).prefault_kv_pool is False
    assert parser.parse_args(["generate", "hi"]).prefault_kv_pool is False
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=64, prefault_kv_pool=True)
    try:
        kv = engine.runner.pool.kv
        assert _resident_bytes(kv) >= kv.numel() * kv.element_size()
        assert engine.generate([[1, 2, 3]], use_tqdm=False)[0].token_ids
    finally:
        engine.close()
