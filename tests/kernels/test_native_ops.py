"""The model's C kernels (skinny matmul, RMSNorm, rotary) against float64 or torch
references, on every tile edge, and the cases they must hand back to torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve.kernels import native_ops
from radixserve.model.layers import RMSNorm, _rotate_half, apply_rotary, linear
from radixserve.kernels.native_ops import (
    MAX_ROWS, gelu_tanh_mul, max_rows, rms_norm, rms_norm_add_, rms_norm_heads_, rope_, silu_mul, skinny_linear,
)

needs_kernel = pytest.mark.skipif(native_ops._skinny_kernel() is None, reason="no C compiler here")
needs_layer_ops = pytest.mark.skipif(native_ops._load("rms_norm_f32") is None, reason="no C compiler here")


def _reference(x, weight, bias):
    out = x.double() @ weight.double().t()
    return (out if bias is None else out + bias.double()).float()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 16, 17, 31, 32, 67, MAX_ROWS])
@pytest.mark.parametrize("features, k", [(1, 8), (2, 64), (3, 16), (4, 8), (5, 24), (7, 576), (9, 40), (48, 136)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_float64(rows, features, k, with_bias):
    if rows > max_rows():
        pytest.skip(f"this build of the kernel takes at most {max_rows()} rows")
    gen = torch.Generator().manual_seed(rows * 1000 + features * 10 + k)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(features, k, generator=gen)
    bias = torch.randn(features, generator=gen) if with_bias else None
    got = skinny_linear(x, weight, bias)
    assert got is not None and got.shape == (rows, features)
    torch.testing.assert_close(got, _reference(x, weight, bias), atol=1e-4, rtol=1e-5)


@needs_kernel
def test_skinny_linear_reads_strided_rows():
    gen = torch.Generator().manual_seed(7)
    for rows in (5, 9, 14):  # quads, pairs, pairs in two passes
        wide = torch.randn(rows, 96, generator=gen)
        x = wide[:, 16:80]  # rows 96 floats apart
        weight = torch.randn(10, 64, generator=gen)
        torch.testing.assert_close(skinny_linear(x, weight, None), _reference(x, weight, None), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("flags", [["-mno-avx512f"], []])
def test_skinny_linear_builds_for_each_vector_width(tmp_path, flags):
    """The AVX-512 tiles (this build) and the AVX2-only tiles (older CPUs) both compute
    the product: the second is built here with AVX-512 switched off."""
    import ctypes
    import shutil

    from radixserve.kernels import native_build

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or native_ops._skinny_kernel() is None:
        pytest.skip("no C compiler here")
    library = tmp_path / "skinny.so"
    native_build._compile(compiler, native_build.CSRC / "skinny_linear.c", ["-fopenmp", *flags], library)
    built = ctypes.CDLL(str(library))
    fn = built.skinny_linear_f32
    fn.argtypes = list(native_build.SIGNATURES["skinny_linear_f32"].argtypes)
    fn.restype = native_build.SIGNATURES["skinny_linear_f32"].restype
    wide = "avx512f" in native_build.cpu_features().split() and not flags
    assert built.skinny_linear_max_rows() == (128 if wide else 32)
    gen = torch.Generator().manual_seed(11)
    for rows, features, k in [(1, 7, 64), (3, 5, 24), (4, 9, 40), (5, 8, 16), (6, 10, 576), (11, 6, 24), (13, 17, 136),
                              (built.skinny_linear_max_rows(), 9, 64)]:
        x, weight, bias = torch.randn(rows, k, generator=gen), torch.randn(features, k, generator=gen), torch.randn(features, generator=gen)
        out = torch.empty(rows, features)
        assert fn(x.data_ptr(), rows, k, weight.data_ptr(), features, k, bias.data_ptr(), out.data_ptr(), features) == 0
        torch.testing.assert_close(out, _reference(x, weight, bias), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    "x, weight",
    [
        (torch.randn(MAX_ROWS + 1, 64), torch.randn(5, 64)),  # too many rows: the BLAS wins
        (torch.randn(0, 64), torch.randn(5, 64)),  # no rows
        (torch.randn(4, 60), torch.randn(5, 60)),  # K not a multiple of 8
        (torch.randn(4, 64, dtype=torch.float64), torch.randn(5, 64, dtype=torch.float64)),
        (torch.randn(4, 64), torch.randn(64, 5).t()),  # weight not contiguous
        (torch.randn(64, 4).t(), torch.randn(5, 64)),  # x columns strided
        (torch.randn(2, 4, 64), torch.randn(5, 64)),  # not a matrix
    ],
)
def test_skinny_linear_declines_what_it_cannot_do(x, weight):
    assert skinny_linear(x, weight, None) is None
    torch.testing.assert_close(linear(x, weight), torch.nn.functional.linear(x, weight), atol=1e-4, rtol=1e-5)


@needs_kernel
def test_model_linear_uses_the_kernel_for_decode_batches(monkeypatch):
    calls = []
    real = native_ops.skinny_linear

    def spy(x, weight, bias):
        out = real(x, weight, bias)
        calls.append(out is not None)
        return out

    monkeypatch.setattr("radixserve.model.layers.skinny_linear", spy)
    x, weight, bias = torch.randn(4, 64), torch.randn(12, 64), torch.randn(12)
    torch.testing.assert_close(linear(x, weight, bias), _reference(x, weight, bias), atol=1e-4, rtol=1e-5)
    assert calls == [True]


# ---- RMSNorm, rotary, SiLU gate ------------------------------------------------------


@needs_layer_ops
@pytest.mark.parametrize("rows, dim", [(1, 576), (5, 64), (300, 40)])
def test_rms_norm_matches_float64(rows, dim):
    gen = torch.Generator().manual_seed(rows + dim)
    x = torch.randn(rows, dim, generator=gen) * 3
    weight = torch.randn(dim, generator=gen)
    ref = (x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * weight.double()).float()
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), ref, atol=1e-5, rtol=1e-5)
    wide = torch.randn(rows, dim + 8, generator=gen)
    strided = wide[:, 8:]  # rows dim + 8 floats apart
    torch.testing.assert_close(rms_norm(strided, weight, 1e-6), rms_norm(strided.contiguous(), weight, 1e-6))


@needs_layer_ops
@pytest.mark.parametrize("rows, dim", [(1, 640), (7, 300), (1152, 640), (3, 40)])
def test_rms_norm_add_is_rms_norm_then_an_add_bit_for_bit(rows, dim):
    """Gemma 3's residual adds of normalized outputs, in place on x (rows strided too): exactly
    the bits of rms_norm followed by torch's add, which the native decoder computes."""
    gen = torch.Generator().manual_seed(rows + dim)
    x = torch.randn(rows, dim + 4, generator=gen)[:, 4:] * 5
    y = torch.randn(rows, dim + 8, generator=gen)[:, :dim] * 3
    weight = torch.randn(dim, generator=gen)
    want = x + rms_norm(y, weight, 1e-6)
    y_before = y.clone()
    assert rms_norm_add_(x, y, weight, 1e-6)
    assert torch.equal(x, want)
    assert torch.equal(y, y_before)
    assert not rms_norm_add_(x.double(), y.double(), weight.double(), 1e-6)
    assert not rms_norm_add_(x, y[:, :-1], weight, 1e-6)
    assert not rms_norm_add_(x[None], y[None], weight, 1e-6)


def test_rms_norm_module_declines_to_torch_for_other_shapes_and_dtypes():
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x3 = torch.randn(4, 3, 64)  # 3-D rows: the module takes torch (q/k norms call rms_norm_heads_)
    assert rms_norm(x3, norm.weight, 1e-6) is None
    torch.testing.assert_close(norm(x3), torch.nn.functional.rms_norm(x3, (64,), norm.weight, 1e-6))
    assert rms_norm(torch.randn(4, 64, dtype=torch.float64), norm.weight, 1e-6) is None


@needs_layer_ops
@pytest.mark.parametrize("tokens, q_heads, k_heads, head_dim", [(1, 9, 3, 64), (7, 4, 4, 128), (300, 2, 1, 16)])
def test_rope_in_place_matches_rotate_half(tokens, q_heads, k_heads, head_dim):
    gen = torch.Generator().manual_seed(tokens)
    # q and k as the model has them: views of one fused qkv row
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim, generator=gen)
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + k_heads) * head_dim].view(tokens, k_heads, head_dim)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1) * 1.1, torch.cat([angles.sin()] * 2, -1) * 1.1
    want_q = q * cos + _rotate_half(q) * sin
    want_k = k * cos + _rotate_half(k) * sin
    v_before = qkv[:, (q_heads + k_heads) * head_dim :].clone()
    assert rope_(q, k, cos.contiguous(), sin.contiguous())
    torch.testing.assert_close(q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (q_heads + k_heads) * head_dim :], v_before)  # v untouched


def test_apply_rotary_declines_to_torch_without_touching_inputs():
    q, k = torch.randn(3, 2, 8, dtype=torch.float64), torch.randn(3, 1, 8, dtype=torch.float64)
    cos, sin = torch.rand(3, 1, 8, dtype=torch.float64), torch.rand(3, 1, 8, dtype=torch.float64)
    q0, k0 = q.clone(), k.clone()
    assert not rope_(q, k, cos, sin)
    out_q, out_k = apply_rotary(q, k, cos, sin)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    torch.testing.assert_close(out_q, q0 * cos + _rotate_half(q0) * sin)
    torch.testing.assert_close(out_k, k0 * cos + _rotate_half(k0) * sin)


@needs_layer_ops
@pytest.mark.parametrize("rows, n", [(1, 1536), (3, 5), (200, 96)])
def test_silu_mul_matches_torch(rows, n):
    gen = torch.Generator().manual_seed(rows + n)
    wide = torch.randn(rows, 2 * n + 4, generator=gen) * 4
    gate_up = wide[:, 4:]  # rows 2n + 4 floats apart
    gate, up = gate_up.split(n, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)


@needs_layer_ops
def test_silu_mul_of_a_very_negative_gate_is_zero_not_nan():
    """exp(-g) overflows past g = -88 (it came out NaN under -ffast-math)."""
    gate = torch.linspace(-400, 40, 128).reshape(1, -1)
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)], dim=1)
    torch.testing.assert_close(silu_mul(gate_up), torch.nn.functional.silu(gate) * 3.0, atol=1e-5, rtol=1e-5)


@needs_layer_ops
@pytest.mark.parametrize("rows, n", [(1, 2048), (3, 5), (200, 96)])
def test_gelu_tanh_mul_matches_float64(rows, n):
    gen = torch.Generator().manual_seed(rows + n)
    wide = torch.randn(rows, 2 * n + 4, generator=gen) * 4
    gate_up = wide[:, 4:]  # rows 2n + 4 floats apart
    gate, up = gate_up.double().split(n, dim=-1)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(gelu_tanh_mul(gate_up).double(), want, atol=1e-5, rtol=1e-5)
    assert gelu_tanh_mul(torch.randn(3, 8, dtype=torch.float64)) is None
    assert gelu_tanh_mul(torch.randn(3, 7)) is None


@needs_layer_ops
@pytest.mark.parametrize("tokens, heads, head_dim", [(1, 4, 256), (7, 3, 64), (300, 1, 16), (1152, 4, 256)])
def test_rms_norm_heads_in_place_matches_float64(tokens, heads, head_dim):
    """q/k norms: every head of q (a view of the fused qkv rows) normalized in place, the rest
    of the row untouched; the 2-D kernel's bits per head."""
    gen = torch.Generator().manual_seed(tokens + heads)
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen) * 3
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    weight = torch.randn(head_dim, generator=gen)
    x = q.double()
    want = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * weight.double()
    rows_2d = rms_norm(q.reshape(tokens * heads, head_dim).contiguous(), weight, 1e-6)
    rest = qkv[:, heads * head_dim:].clone()
    assert rms_norm_heads_(q, weight, 1e-6)
    torch.testing.assert_close(q.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(q.reshape(tokens * heads, head_dim), rows_2d)
    assert torch.equal(qkv[:, heads * head_dim:], rest)
    assert not rms_norm_heads_(torch.randn(2, 3, 8, dtype=torch.float64), weight[:8], 1e-6)
    assert not rms_norm_heads_(torch.randn(2, 24)[:, :16].view(2, 2, 8)[:, :, :4], weight[:4], 1e-6)


def test_silu_mul_declines_to_torch():
    assert silu_mul(torch.randn(3, 8, dtype=torch.float64)) is None
    assert silu_mul(torch.randn(3, 7)) is None  # no even split
    assert silu_mul(torch.randn(2, 3, 8)) is None


@needs_kernel
def test_build_all_builds_every_c_source_of_the_package():
    from radixserve.kernels.native_build import build_all

    assert build_all() == ["decoder_layers.c", "delta_rule.c", "layer_ops.c", "moe_experts.c", "paged_attention.c",
                           "prefill_attention.c", "quant_linear.c", "skinny_linear.c"]


@needs_kernel
@pytest.mark.parametrize("source", sorted(p.name for p in (Path(__file__).parents[2] / "radixserve/kernels/csrc").glob("*.c")))
def test_every_c_source_builds_with_openmp(tmp_path, source):
    """A source that fails to build with -fopenmp is built without it, with a warning only, and its
    parallel regions then run on one thread: where the compiler has OpenMP, each must build with it."""
    from radixserve.kernels import native_build

    compiler = native_build.os.environ.get("CC") or native_build.shutil.which("cc") or native_build.shutil.which("gcc")
    probe = tmp_path / "probe.c"
    probe.write_text("#include <omp.h>\nint f(void) { return omp_get_max_threads(); }\n")
    try:
        native_build._compile(compiler, probe, native_build._OPENMP, tmp_path / "probe.so")
    except subprocess.CalledProcessError:
        pytest.skip("this compiler has no OpenMP")
    try:
        native_build._compile(compiler, native_build.CSRC / source, native_build._OPENMP, tmp_path / "k.so")
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"{source} does not build with OpenMP:\n{exc.stderr[:2000]}")


@needs_kernel
def test_loading_the_kernels_keeps_subnormals():
    """Linking a shared object with -ffast-math turns on flush-to-zero for the whole process
    when it loads; the kernels are compiled with it but must be linked without it."""
    code = (
        "import sys; x = float('5e-324')\n"
        "from radixserve.kernels.native_build import CSRC, build_all\n"
        "assert len(build_all()) == len(list(CSRC.glob('*.c')))\n"
        "sys.exit(0 if x * 1.0 == x else 1)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 0


def test_skinny_linear_declines_mismatched_shapes():
    x = torch.randn(4, 64)
    assert skinny_linear(x, torch.randn(5, 72), None) is None  # K differs
    assert skinny_linear(x, torch.randn(5, 64), torch.randn(6)) is None  # bias length differs
    with pytest.raises(RuntimeError):
        linear(x, torch.randn(5, 72))  # torch's own error, not a read past the weight


# ---- the builder: one declared signature per kernel, one build per CPU ---------------------


def _c_prototypes(source: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (return type, parameter types) of the exported functions of a C source."""
    import re

    from radixserve.kernels.native_build import CSRC

    text = (CSRC / source).read_text()
    found = {}
    for ret, name, params in re.findall(r"^(int|void)\s+(\w+)\s*\(([^)]*)\)\s*\{", text, re.M):
        types = [] if params.strip() in ("", "void") else [
            "ptr" if "*" in p else p.replace("const", "").split()[0] for p in params.split(",")
        ]
        found[name] = (ret, types)
    return found


def test_every_declared_signature_matches_its_c_prototype():
    import ctypes

    from radixserve.kernels.native_build import SIGNATURES

    as_ctypes = {"ptr": ctypes.c_void_p, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
    exported = {}
    for source in {s.source for s in SIGNATURES.values()}:
        exported.update(_c_prototypes(source))
    for name, signature in SIGNATURES.items():
        ret, params = exported[name]
        assert [as_ctypes[p] for p in params] == list(signature.argtypes), name
        assert signature.restype is (ctypes.c_int if ret == "int" else None), name
    assert set(exported) == set(SIGNATURES), "every exported kernel is declared, and only those"


def test_build_path_is_keyed_on_the_cpu_and_the_compiler(tmp_path, monkeypatch):
    from radixserve.kernels import native_build

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    source = native_build.CSRC / "layer_ops.c"
    x86 = "x86_64\nmodel name: AMD EPYC\nflags: fpu sse2 avx avx2 fma"
    wider = x86 + " avx512f avx512bw"
    path = native_build.build_path(source, "cc", x86)
    assert path == native_build.build_path(source, "cc", x86)
    assert path.parent == tmp_path / "kernels" and path.name.startswith("layer_ops-")
    assert native_build.build_path(source, "cc", wider) != path, "more CPU features, another build"
    assert native_build.build_path(source, "cc", x86.replace("EPYC", "Xeon")) != path
    monkeypatch.setattr(native_build, "_compiler_version", lambda compiler: "cc 99.1")
    assert native_build.build_path(source, "cc", x86) != path, "another compiler version, another build"
    assert native_build.build_path(source, "cc") == native_build.build_path(source, "cc", native_build.cpu_features())


def test_cpu_features_name_this_cpu():
    from radixserve.kernels.native_build import cpu_features

    import platform

    features = cpu_features()
    assert features.startswith(platform.machine())
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        pytest.skip("no feature flags in /proc/cpuinfo here")
    assert " ".join(flags.split(":", 1)[1].split()) in features


@needs_kernel
def test_a_build_for_another_cpu_goes_to_another_file(tmp_path, monkeypatch):
    """A cache shared with a machine of other CPU features: this machine builds its own copy
    beside the other's instead of loading it."""
    from radixserve.kernels import native_build

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    source = native_build.CSRC / "layer_ops.c"
    mine = native_build._build(source)
    monkeypatch.setattr(native_build, "cpu_features", lambda: "x86_64\nflags: sse2 avx512f")
    theirs = native_build._build(source)
    assert mine != theirs and mine.is_file() and theirs.is_file()
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == sorted([mine.name, theirs.name])


def test_model_ops_switch_off_with_the_environment_variable(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_NATIVE_CPU", "0")
    native_ops._load.cache_clear()
    try:
        assert rms_norm(torch.randn(2, 64), torch.ones(64), 1e-6) is None
        assert silu_mul(torch.randn(2, 64)) is None
    finally:
        native_ops._load.cache_clear()
