"""Every Triton kernel the triton attention backend launches, compiled for real GPU targets, on a machine without one.

Triton's interpreter (TRITON_INTERPRET=1, the other kernel tests) runs code that compiled
Triton rejects: the int8 decode/extend kernels once had a helper with two returns of
different types, which the interpreter ran happily and no GPU could compile. This test
compiles the kernels through Triton's own launch path, as a real launch would:

  * the launches are the backend's own: TritonAttentionBackend.forward runs on tensors that
    say they are on CUDA (meta tensors underneath, so nothing is allocated), on the KV pool
    the runner builds (KVPool: model-dtype caches or quantized pages), and each kernel's
    `kernel[grid](...)` is caught, so the shapes, strides, dtypes, constexprs, num_warps and
    num_stages are whatever the launch code computes for CUDA (BLOCK_N, the extend tiles, the
    split-K choice from the SM count, DOT_IN_FP32 off);
  * each caught launch goes to `kernel.warmup(...)` under a stand-in driver that names a GPU
    target, so Triton's binder specializes the arguments (pointer alignment, ints) as on a GPU
    and compiles through every stage: TTIR, TTGIR, LLVM IR, PTX and, with the ptxas Triton
    bundles (backends/nvidia/bin), a cubin; ptxas's errors are caught too. Without a CUDA
    backend or without that ptxas the test skips.

Two steps per case reach all five kernels: a mixed step (short decodes, one pass, and a
prefill chunk over a cached prefix) and one long decode (split-K and its merge), each run as a
full layer and as a sliding-window one (the attention kernels' WINDOWED variants). Cases: the
default model's geometry (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64) and a
GQA 4:1 head_dim 128 one, at the engine's default block size, for each KV page kind
(float32 and bfloat16 caches, int8 and fp8_e4m3 pages under a bfloat16 model), for sm_90
(H100/H200), and sm_80 (A100) for all but fp8, which quantized_pages.py refuses below
compute capability 8.9. Assertions: every kernel compiles; its PTX has the kernel's entry
for the right target; its shared memory fits the architecture; fp8 attention PTX converts
e4m3 in hardware and the int8 and model-dtype kernels' PTX does not.

The compiles run in a subprocess (this file run as a script) with TRITON_INTERPRET unset,
since triton fixes its mode when first imported and the other kernel tests import it
interpreted; it uses its own Triton cache directory, so every run really compiles. The
default geometry on sm_90 is the fast test; the other three groups are one slow test; each
test compiles in two workers side by side (LLVM and ptxas run on one core).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DEFAULT_GEOMETRY = "smollm2"  # SmolLM2-135M, the default model
GEOMETRIES = {  # name: (num_heads, num_kv_heads, head_dim)
    DEFAULT_GEOMETRY: (9, 3, 64),
    "gqa4_d128": (32, 8, 128),
}
KINDS = {  # KV page kind: (model dtype, kv_cache_dtype)
    "float32": ("float32", "auto"),
    "bfloat16": ("bfloat16", "auto"),
    "int8": ("bfloat16", "int8"),
    "fp8_e4m3": ("bfloat16", "fp8_e4m3"),
}
# Compute capability: (SM count of the part the split-K choice is sized for, max shared memory per block).
ARCHS = {
    90: (132, 232448),  # H100/H200 SXM: 227 KiB opt-in
    80: (108, 166912),  # A100: 163 KiB opt-in
}
# What each case must have compiled, as (kernel, SPLIT, WINDOWED): the decode kernel both ways,
# the attention kernels for full layers and for sliding-window ones.
EXPECTED = {("_store_kv_kernel", None, None), ("_merge_splits_kernel", None, None),
            *(("_decode_kernel", split, windowed) for split in (False, True) for windowed in (False, True)),
            *(("_extend_kernel", None, windowed) for windowed in (False, True))}
WINDOW = 100  # each step runs once more as a layer of this sliding window (the long decode: 4096)
_REPO = Path(__file__).resolve().parents[2]
_MARK = "RESULTS-JSON:"


def _kinds_for(arch: int) -> list[str]:
    from radixserve.kernels.quantized_pages import FP8_MIN_CAPABILITY  # imports no triton

    return [kind for kind in KINDS if kind != "fp8_e4m3" or (arch // 10, arch % 10) >= FP8_MIN_CAPABILITY]


def _compile_in_subprocess(cases: list[tuple[str, str, int]], cache_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache_dir), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, __file__, json.dumps(cases)], env=env, cwd=_REPO,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"compile worker exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len(_MARK):])


def _compile_side_by_side(cases: list[tuple[str, str, int]], cache_dir: Path) -> dict:
    """The cases split between two compile workers (LLVM and ptxas run on one core each), one report."""
    halves = [cases[0::2], cases[1::2]]
    with concurrent.futures.ThreadPoolExecutor(len(halves)) as pool:
        reports = list(pool.map(lambda i: _compile_in_subprocess(halves[i], cache_dir / str(i)), range(len(halves))))
    return dict(reports[0], cases={k: v for report in reports for k, v in report.get("cases", {}).items()})


def _group_cases(geometry: str, arch: int) -> list[tuple[str, str, int]]:
    return [(geometry, kind, arch) for kind in _kinds_for(arch)]


def _check_report(geometry: str, arch: int, report: dict) -> None:
    kinds = _kinds_for(arch)
    if "skip" in report:
        pytest.skip(report["skip"])
    assert Path(report["radixserve"]).is_relative_to(_REPO), f"the worker compiled {report['radixserve']}'s kernels"
    failures = []
    for kind in kinds:
        case = f"{geometry}/{kind}/sm_{arch}"
        compiled = report["cases"][f"{geometry}/{kind}/{arch}"]
        if "error" in compiled:
            failures.append(f"{case}: the backend's forward failed before or while compiling:\n{compiled['error']}")
            continue
        seen = {(k["kernel"], k["constexprs"].get("SPLIT"), k["constexprs"].get("WINDOWED"))
                for k in compiled["kernels"]}
        if seen != EXPECTED:
            failures.append(f"{case}: launched {sorted(seen, key=str)}, expected {sorted(EXPECTED, key=str)}")
        for k in compiled["kernels"]:
            what = f"{case} {k['kernel']} {k['constexprs']} num_warps={k['num_warps']}"
            if "error" in k:
                failures.append(f"{what} does not compile:\n{k['error']}")
                continue
            failures += [f"{what}: {problem}" for problem in _problems(k, kind, arch)]
    assert not failures, "\n\n".join(failures)


def _problems(k: dict, kind: str, arch: int) -> list[str]:
    problems = []
    if f".entry {k['kernel']}(" not in k["ptx"]:
        problems.append("no PTX entry for the kernel")
    if f".target sm_{arch}" not in k["ptx"]:
        problems.append(f"PTX is not for sm_{arch}")
    if not k["cubin_bytes"]:
        problems.append("empty cubin")
    if k["shared"] > ARCHS[arch][1]:
        problems.append(f"needs {k['shared']} bytes of shared memory, sm_{arch} has {ARCHS[arch][1]} per block")
    e4m3 = k["ptx"].count("e4m3")
    # fp8 pages are dequantized by hardware e4m3 conversions; the store encodes e4m3 by
    # integer arithmetic (store_kv._e4m3_bits), so it has none; no other kind may have any.
    attention = k["kernel"] in ("_decode_kernel", "_extend_kernel")
    if kind == "fp8_e4m3" and attention and not e4m3:
        problems.append("fp8 attention PTX has no e4m3 conversion")
    if (kind != "fp8_e4m3" or not attention) and e4m3:
        problems.append(f"{e4m3} unexpected e4m3 instructions in the PTX")
    if kind == "int8" and attention and ".s8" not in k["ptx"]:
        problems.append("int8 attention PTX never reads a signed byte")
    return problems


def test_default_geometry_compiles_for_sm90(tmp_path):
    _check_report(DEFAULT_GEOMETRY, 90, _compile_side_by_side(_group_cases(DEFAULT_GEOMETRY, 90), tmp_path))


OTHER_GROUPS = [(geometry, arch) for geometry in GEOMETRIES for arch in ARCHS if (geometry, arch) != (DEFAULT_GEOMETRY, 90)]


@pytest.mark.slow
def test_kernels_compile_for_the_other_geometries_and_targets(tmp_path):
    """The other groups, each checked as the fast test checks its own."""
    report = _compile_side_by_side([c for group in OTHER_GROUPS for c in _group_cases(*group)], tmp_path)
    problems = []
    for geometry, arch in OTHER_GROUPS:
        try:
            _check_report(geometry, arch, report)  # reads only its own group's cases
        except AssertionError as exc:
            problems.append(f"{geometry} sm_{arch}: {exc}")
    assert not problems, "\n\n".join(problems)


# ---- the compile worker (this file run as a script, TRITON_INTERPRET unset) ----------------


def _worker(cases: list[tuple[str, str, int]]) -> dict:
    import traceback

    import torch

    try:
        import triton
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime import driver
    except ImportError as exc:
        return {"skip": f"triton cannot be imported: {exc}"}
    if "nvidia" not in backends:
        return {"skip": f"this Triton build ({triton.__version__}) has no CUDA backend (backends: {sorted(backends)})"}
    try:
        make_backend(GPUTarget("cuda", 90, 32))
    except Exception as exc:  # any failure means: cannot target CUDA here
        return {"skip": f"this Triton build ({triton.__version__}) cannot target CUDA: {exc!r}"}
    if not _has_ptxas():  # Triton compiles through to a cubin: without ptxas every kernel would "fail"
        return {"skip": f"this Triton build ({triton.__version__}) has no ptxas for sm_90"}

    from radixserve.attention.kv_pool import KVPool
    from radixserve.attention.metadata import AttentionMetadata
    from radixserve.attention.registry import get_backend_class
    from radixserve.config import EngineConfig
    from radixserve.kernels.triton import decode_attention, extend_attention, store_kv

    block_size = EngineConfig.__dataclass_fields__["block_size"].default
    fake = _FakeDriver({i: arch for i, arch in enumerate(ARCHS)})
    driver.set_active(fake)
    compiled: list[dict] = []
    modules = {"_store_kv_kernel": store_kv, "_decode_kernel": decode_attention,
               "_merge_splits_kernel": decode_attention, "_extend_kernel": extend_attention}
    for name, module in modules.items():
        setattr(module, name, _CompileLaunch(getattr(module, name), compiled))

    results = {}
    for geometry, kind, arch in cases:
        num_heads, num_kv_heads, head_dim = GEOMETRIES[geometry]
        dtype_name, kv_cache_dtype = KINDS[kind]
        dtype = getattr(torch, dtype_name)
        fake.device = list(ARCHS).index(arch)  # its own device id: JITFunction caches per device
        decode_attention._num_sms = lambda device, sms=ARCHS[arch][0]: sms
        compiled.clear()
        try:
            with _cuda_factories():
                pool = KVPool(1, 4096, block_size, num_kv_heads, head_dim, dtype, torch.device("cuda"), kv_cache_dtype)
                backend = get_backend_class("triton")(num_heads, num_kv_heads, head_dim, head_dim**-0.5, dtype,
                                                      pool.pages)
                k_cache, v_cache = pool.layer(0)
                for step in _steps(block_size):
                    meta = _metadata(AttentionMetadata, step, block_size)
                    tokens = meta.query_start_loc_list[-1]
                    q = torch.empty(tokens, num_heads, head_dim, dtype=dtype, device="cuda")
                    k, v = (torch.empty(tokens, num_kv_heads, head_dim, dtype=dtype, device="cuda") for _ in range(2))
                    plan = backend.prepare(meta)
                    backend.forward(q, k, v, k_cache, v_cache, plan)
                    backend.forward(q, k, v, k_cache, v_cache, plan, WINDOW if tokens > 1 else 4096)
            results[f"{geometry}/{kind}/{arch}"] = {"kernels": _dedupe(compiled)}
        except Exception:  # reported, with the kernels compiled so far
            results[f"{geometry}/{kind}/{arch}"] = {"error": traceback.format_exc()[-4000:], "kernels": compiled[:]}
    import radixserve

    return {"cases": results, "triton": triton.__version__, "radixserve": radixserve.__file__}


def _steps(block_size: int) -> list[list[tuple[int, int]]]:
    """(context length after the step, new tokens) per request, decodes first: a mixed step
    with short decodes (one pass) and a chunk over a cached prefix, then one long decode
    (split-K to the most splits, and the merge)."""
    return [[(40, 1), (7, 1), (2 * block_size + 20, 20)], [(32768, 1)]]


def _metadata(metadata_class, step: list[tuple[int, int]], block_size: int):
    import torch

    starts, slots, tables, next_block = [0], [], [], 1
    for context, new in step:
        blocks = -(-context // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
        starts.append(starts[-1] + new)
        slots += [tables[-1][p // block_size] * block_size + p % block_size for p in range(context - new, context)]
    width = max(len(t) for t in tables)
    seq_lens = [context for context, _ in step]
    return metadata_class(
        num_decodes=sum(1 for _, new in step if new == 1),
        block_size=block_size,
        query_start_loc=torch.empty(len(starts), dtype=torch.int32, device="cuda"),
        seq_lens=torch.empty(len(seq_lens), dtype=torch.int32, device="cuda"),
        block_tables=torch.empty(len(tables), width, dtype=torch.int32, device="cuda"),
        slot_mapping=torch.empty(len(slots), dtype=torch.int64, device="cuda"),
        query_start_loc_list=starts,
        seq_lens_list=seq_lens,
    )


def _dedupe(compiled: list[dict]) -> list[dict]:
    seen, out = set(), []
    for k in compiled:
        key = (k["kernel"], json.dumps(k["constexprs"], sort_keys=True), k.get("signature"))
        if key not in seen:
            seen.add(key)
            out.append(k)
    return out


class _CompileLaunch:
    """Stands in for a @triton.jit kernel in its module: `kernel[grid](*args, **kwargs)`
    compiles what that launch would run (Triton's warmup: its binder and compiler, no launch)."""

    def __init__(self, fn, compiled: list[dict]):
        self.fn, self.compiled = fn, compiled

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._compile(grid, args, kwargs)

    def _compile(self, grid, args, kwargs) -> None:
        import traceback

        constexprs = {p.name: _jsonable(kwargs[p.name]) for p in self.fn.params if p.is_constexpr}
        record = {"kernel": self.fn.__name__, "constexprs": constexprs, "num_warps": kwargs.get("num_warps"),
                  "num_stages": kwargs.get("num_stages")}
        try:
            kernel = self.fn.warmup(*[_pointer(a) for a in args], grid=grid, **kwargs)
            record.update(ptx=kernel.asm["ptx"], cubin_bytes=len(kernel.asm.get("cubin", b"")),
                          shared=kernel.metadata.shared, signature=json.dumps(kernel.src.signature, default=str))
        except Exception:  # a kernel that does not compile is the finding
            record["error"] = traceback.format_exc()[-6000:]
        self.compiled.append(record)


def _jsonable(value):
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)


class _Pointer:
    """What Triton's binder reads of a tensor argument: its dtype and its address, here a
    512-byte-aligned base (the CUDA caching allocator's) plus the view's offset."""

    def __init__(self, tensor):
        self.dtype = tensor.dtype
        self._address = (1 << 30) + tensor.storage_offset() * tensor.element_size()

    def data_ptr(self) -> int:
        return self._address


def _pointer(arg):
    import torch

    return _Pointer(arg) if isinstance(arg, torch.Tensor) else arg


def _has_ptxas() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return Path(get_ptxas(90).path).exists()
    except Exception:
        return False


class _FakeDriver:
    """The three things JITFunction.warmup asks the driver: device, stream, target. Each device
    id is one compute capability."""

    def __init__(self, archs: dict[int, int]):
        from triton.backends.compiler import GPUTarget

        self.targets = {i: GPUTarget("cuda", arch, 32) for i, arch in archs.items()}
        self.device = 0

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.targets[self.device]

    def is_active(self) -> bool:
        return True


def _cuda_tensor_types():
    """A meta tensor that says it is on CUDA, and a mode that makes CUDA factories make them,
    so the launch code takes its CUDA branches and allocates nothing."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_map

    cuda, meta = torch.device("cuda", 0), torch.device("meta")

    def call(func, args, kwargs):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if func is not torch.device and device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = meta
        args, kwargs = tree_map(lambda x: x.as_subclass(torch.Tensor) if isinstance(x, OnCuda) else x, (args, kwargs))
        out = func(*args, **kwargs)
        return tree_map(lambda x: x.as_subclass(OnCuda) if isinstance(x, torch.Tensor) and x.is_meta else x, out)

    class OnCuda(torch.Tensor):
        @property
        def device(self):
            return cuda

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            with torch._C.DisableTorchFunctionSubclass():
                return call(func, args, kwargs)

    class CudaFactories(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return call(func, args, kwargs)

    return CudaFactories


def _cuda_factories():
    return _cuda_tensor_types()()


if __name__ == "__main__":
    print(_MARK + json.dumps(_worker([tuple(case) for case in json.loads(sys.argv[1])])))
