"""Attention backend registry: factories import lazily, so the package imports without Triton.

    torch   plain torch ops, any device and dtype; int8 and fp8_e4m3 pages
    cpu     C kernels on CPU (store, decode and prompt attention in place through the block tables),
            float32 pools and int8 pages
    triton  Triton kernels on CUDA (in Triton's interpreter elsewhere, for tests); int8 and
            fp8_e4m3 pages (fp8 compiled from compute capability 8.9 on)
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from radixserve.attention.backend import AttentionBackend

logger = logging.getLogger(__name__)


def _torch_backend() -> type[AttentionBackend]:
    from radixserve.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend


def _cpu_backend() -> type[AttentionBackend]:
    from radixserve.attention.cpu_backend import CpuAttentionBackend

    return CpuAttentionBackend


def _triton_backend() -> type[AttentionBackend]:
    from radixserve.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


_FACTORIES: dict[str, Callable[[], type[AttentionBackend]]] = {
    "torch": _torch_backend,
    "cpu": _cpu_backend,
    "triton": _triton_backend,
}


def available_backends() -> list[str]:
    return sorted(_FACTORIES)


def resolve_backend_name(name: str, device: torch.device) -> str:
    """'auto' means triton on CUDA, and on CPU cpu where its C kernels build here, else
    torch (logged). 'cpu' needs a CPU device and its kernels; ValueError otherwise."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            return "triton"
        if device.type == "cpu" and _cpu_kernels_build():
            return "cpu"
        logger.warning("attention backend auto: no C kernels for %s here; using the pure-torch backend", device)
        return "torch"
    if name not in _FACTORIES:
        raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(available_backends())}")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu attention backend runs on CPU only, not on {device}; use auto, triton or torch")
    if name == "cpu" and not _cpu_kernels_build():
        raise ValueError("the cpu attention backend needs its C kernels, which could not be built here "
                         "(see the warning above: a C compiler is needed); use 'torch'")
    return name


def get_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _FACTORIES:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(available_backends())}")
    return _FACTORIES[name]()


def _cpu_kernels_build() -> bool:
    from radixserve.kernels.native_attention import load_native_attention

    return load_native_attention() is not None
