"""build_native / load_kernel: compile radixserve's C sources for this CPU, load them, and
bind each kernel to its one declared signature.

The CPU kernels (paged attention, skinny matmul, layer ops) are small C files built on
first use with the system compiler into the cache directory (a second or two, once per
source, flags, compiler and CPU) and called through ctypes, which releases the GIL for
the call. They are built with OpenMP: the shared object names `libgomp.so.1`, which the
loader resolves to the copy torch has already loaded, so the kernels' threads are torch's
own workers (a second pool would fight torch's spinning workers for the cores). Without
a compiler callers get None and keep their pure-torch paths.

They are built with -march=native, so a build is only valid on a CPU with the same
features: the cached file's name is a digest of the source, the flags, the compiler's
version and the CPU's model name and feature flags. A cache directory shared between
machines (a home directory on NFS, an image built elsewhere) then holds one build per
kind of CPU instead of handing one CPU's code to another (an illegal instruction).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from radixserve.config import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC"]
# Linked without -ffast-math: linking a shared object with it pulls in crtfastmath.o, whose
# constructor turns on flush-to-zero for the whole process when the kernel is loaded.
_LINK_FLAGS = ["-shared", "-fPIC"]
_OPENMP = ["-fopenmp"]  # dropped, with a warning, where the compiler has no OpenMP

_PTR, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


@dataclass(frozen=True)
class Signature:
    """A C kernel's prototype as ctypes sees it (pointers are void*)."""

    source: str  # the file in csrc/ that defines it
    argtypes: tuple[type, ...]
    restype: type | None  # None: void


# Every kernel the package calls, declared once; tests/kernels/test_native_ops.py checks each
# against its prototype in the C source.
SIGNATURES: dict[str, Signature] = {
    "paged_decode_attention_f32": Signature(
        "paged_attention.c",
        (_PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _I64, _PTR, _PTR),
        _INT,
    ),
    "paged_prefill_attention_i8": Signature(
        "prefill_attention.c",
        (_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64,
         _I64, _F32, _I64, _I64, _PTR), _INT,
    ),
    "paged_prefill_attention_f32": Signature(
        "prefill_attention.c",
        (_PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _F32,
         _I64, _I64, _PTR), _INT,
    ),
    "paged_prefill_bf16_available": Signature("prefill_attention.c", (_I64,), _INT),
    "paged_store_f32": Signature("paged_attention.c", (_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64), _INT),
    "paged_decode_attention_i8": Signature(
        "paged_attention.c",
        (_PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _I64,
         _PTR, _PTR), _INT,
    ),
    "paged_store_i8": Signature(
        "paged_attention.c", (_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64), _INT,
    ),
    "skinny_linear_available": Signature("skinny_linear.c", (), _INT),
    "skinny_linear_max_rows": Signature("skinny_linear.c", (), _INT),
    "skinny_linear_f32": Signature("skinny_linear.c", (_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64), _INT),
    "rms_norm_f32": Signature("layer_ops.c", (_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _F32), None),
    "rope_f32": Signature("layer_ops.c", (_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64), None),
    "silu_mul_f32": Signature("layer_ops.c", (_PTR, _I64, _PTR, _I64, _I64), None),
    "gelu_tanh_mul_f32": Signature("layer_ops.c", (_PTR, _I64, _PTR, _I64, _I64), None),
    "rms_norm_heads_f32": Signature("layer_ops.c", (_PTR, _I64, _I64, _I64, _I64, _PTR, _F32), None),
    "rms_norm_add_f32": Signature("layer_ops.c", (_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _F32), None),
    "hadamard_heads_f32": Signature("layer_ops.c", (_PTR, _I64, _I64, _I64, _I64), None),
    "delta_rule_step_f32": Signature(
        "delta_rule.c", (_PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR), _INT,
    ),
    "quant_linear_best_path": Signature("quant_linear.c", (), _INT),
    "quant_linear_f32": Signature(
        "quant_linear.c",
        (_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64), _INT,
    ),
    "quant_dequantize_f32": Signature(
        "quant_linear.c", (_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR), _INT,
    ),
    "moe_experts_f32": Signature(
        "moe_experts.c",
        (_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64), _INT,
    ),
    "decoder_layers_f32": Signature(
        "decoder_layers.c",
        (_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR,
         _PTR),
        _INT,
    ),
}


@functools.cache
def load_kernel(name: str):
    """The C function `name` of SIGNATURES, typed, or None when its source cannot be built here."""
    signature = SIGNATURES[name]
    library = build_native(CSRC / signature.source)
    if library is None:
        return None
    fn = getattr(library, name)
    fn.argtypes = list(signature.argtypes)
    fn.restype = signature.restype
    return fn


@functools.cache
def build_native(source: Path) -> ctypes.CDLL | None:
    """The compiled library of `source`, or None (logged) when it cannot be built here."""
    import torch  # noqa: F401  (torch's libgomp must be loaded before the kernel's)

    try:
        return ctypes.CDLL(str(_build(source)))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as exc:
        logger.warning("native CPU kernel %s unavailable (%s); using pure torch", source.name, exc)
        return None


def build_all() -> list[str]:
    """Build every C source of the package (what `radixserve prepare` does, so that no
    request waits for a compiler); returns the names of those now available."""
    return [source.name for source in sorted(CSRC.glob("*.c")) if build_native(source) is not None]


@functools.cache
def cpu_features() -> str:
    """What -march=native compiles for: the machine, and from /proc/cpuinfo the first
    processor's model name and feature flags (x86 `flags`, Arm `Features` and part)."""
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part", "isa")
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in wanted and key not in fields:
            fields[key] = " ".join(value.split())
    described = "\n".join(f"{key}: {fields[key]}" for key in wanted if key in fields)
    return f"{platform.machine()}\n{described or platform.processor()}"


def build_path(source: Path, compiler: str, cpu: str | None = None) -> Path:
    """Where the build of `source` for this compiler and CPU (`cpu_features()` unless
    given) lives in the cache: one file per source, flags, compiler version and CPU."""
    key = hashlib.sha256()
    for part in (_source_text(source), " ".join([*_FLAGS, *_LINK_FLAGS, *_OPENMP]).encode(), compiler.encode(),
                 _compiler_version(compiler).encode(), (cpu_features() if cpu is None else cpu).encode()):
        key.update(hashlib.sha256(part).digest())
    return cache_root() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _source_text(source: Path) -> bytes:
    """The source's bytes followed by those of every file it includes with `#include "..."`
    (from its own directory, recursively): a build depends on all of them."""
    seen: list[Path] = []

    def visit(path: Path) -> None:
        if path in seen:
            return
        seen.append(path)
        for name in _LOCAL_INCLUDE.findall(path.read_text()):
            visit(path.parent / name)

    visit(source)
    return b"".join(path.read_bytes() for path in seen)


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _build(source: Path) -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    target = build_path(source, compiler)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        built = Path(work) / target.name
        try:
            _compile(compiler, source, _OPENMP, built)
        except subprocess.CalledProcessError as exc:
            logger.warning("building %s with OpenMP failed (%s); it will use one thread",
                           source.name, exc.stderr.strip()[:200])
            _compile(compiler, source, [], built)
        os.replace(built, target)
    return target


@functools.cache
def _compiler_version(compiler: str) -> str:
    """The compiler's own description of itself (`cc --version`), or '' if it gives none."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip()


def _compile(compiler: str, source: Path, extra: list[str], output: Path) -> None:
    obj = output.with_suffix(".o")
    try:
        for cmd in ([compiler, *_FLAGS, *extra, "-c", str(source), "-o", str(obj)],
                    [compiler, *_LINK_FLAGS, *extra, str(obj), "-o", str(output), "-lm"]):
            subprocess.run(cmd, check=True, capture_output=True, text=True)
    finally:
        obj.unlink(missing_ok=True)
