"""RunnerConfig: what a ModelRunner is built from, made from the EngineConfig in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.attention.backend import AttentionOptions
from radixserve.config import EngineConfig


@dataclass(frozen=True)
class RunnerConfig:
    """The runner's settings, resolved: a backend name that is no longer `auto`, the device and
    the model's dtype as loaded, the pool's size in blocks."""

    num_blocks: int
    block_size: int
    backend: str  # torch, cpu or triton (attention/registry.py resolves auto)
    device: torch.device
    dtype: torch.dtype  # the model's activations; the KV pool's too unless kv_cache_dtype quantizes
    seed: int = 0
    kv_cache_dtype: str = "auto"
    prefault_kv_pool: bool = False
    native_decoder: bool = True
    onednn_linear: bool = True
    prefill_matmul_dtype: str = "float32"
    quantized_prompt_matmul: str = "integer"
    attention: AttentionOptions = field(default_factory=AttentionOptions)  # the backend's own (configure)

    @classmethod
    def from_engine(cls, cfg: EngineConfig, *, num_blocks: int, backend: str, device: torch.device,
                    dtype: torch.dtype) -> RunnerConfig:
        return cls(
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            backend=backend,
            device=device,
            dtype=dtype,
            seed=cfg.seed,
            kv_cache_dtype=cfg.kv_cache_dtype,
            prefault_kv_pool=cfg.prefault_kv_pool,
            native_decoder=cfg.native_decoder,
            onednn_linear=cfg.onednn_linear,
            prefill_matmul_dtype=cfg.prefill_matmul_dtype,
            quantized_prompt_matmul=cfg.quantized_prompt_matmul,
            attention=AttentionOptions(cfg.tiled_prefill_attention, cfg.prefill_attention_dtype),
        )
