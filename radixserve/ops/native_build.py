"""build_native: compile one of radixserve's C sources for this CPU and load it.

The CPU kernels (decode attention, skinny matmul) are small C files built on first use
with the system compiler into the cache directory (a second or two, once per source and
flags) and called through ctypes, which releases the GIL for the call. They are built
with OpenMP: the shared object names `libgomp.so.1`, which the loader resolves to the
copy torch has already loaded, so the kernels' threads are torch's own workers (a
second pool would fight torch's spinning workers for the cores). Without a compiler,
or with RADIXSERVE_NATIVE_CPU=0, callers get None and keep their pure-torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-shared"]
_OPENMP = ["-fopenmp"]  # dropped, with a warning, where the compiler has no OpenMP


def native_enabled() -> bool:
    return os.environ.get("RADIXSERVE_NATIVE_CPU", "1") != "0"


@functools.cache
def build_native(source: Path) -> ctypes.CDLL | None:
    """The compiled library of `source`, or None (logged) when it cannot be built here."""
    if not native_enabled():
        return None
    import torch  # noqa: F401  (torch's libgomp must be loaded before the kernel's)

    try:
        return ctypes.CDLL(str(_build(source)))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as exc:
        logger.warning("native CPU kernel %s unavailable (%s); using pure torch", source.name, exc)
        return None


def build_all() -> list[str]:
    """Build every C source of the package (what `radixserve prepare` does, so that no
    request waits for a compiler); returns the names of those now available."""
    root = Path(__file__).parent
    return [source.name for source in sorted((root / "csrc").glob("*.c")) if build_native(source) is not None]


def _build(source: Path) -> Path:
    from radixserve.model.default_model import cache_root

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join([compiler, *_FLAGS, *_OPENMP]).encode() + os.uname().machine.encode())
    target = cache_root() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"
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


def _compile(compiler: str, source: Path, extra: list[str], output: Path) -> None:
    subprocess.run(
        [compiler, *_FLAGS, *extra, str(source), "-o", str(output), "-lm"],
        check=True, capture_output=True, text=True,
    )
