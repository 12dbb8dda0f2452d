"""Attention backend registry: factories import lazily, so the package imports without Triton."""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.attention.backend import AttentionBackend


def _torch_backend() -> type[AttentionBackend]:
    from radixserve.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend


def _triton_backend() -> type[AttentionBackend]:
    from radixserve.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


_FACTORIES: dict[str, Callable[[], type[AttentionBackend]]] = {
    "torch": _torch_backend,
    "triton": _triton_backend,
}


def available_backends() -> list[str]:
    return sorted(_FACTORIES)


def resolve_backend_name(name: str, device: torch.device) -> str:
    """'auto' means triton on CUDA and torch elsewhere."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name not in _FACTORIES:
        raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(available_backends())}")
    return name


def get_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _FACTORIES:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(available_backends())}")
    return _FACTORIES[name]()
