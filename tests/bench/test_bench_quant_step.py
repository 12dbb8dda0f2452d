"""bench_quant_step on the default model's repacked weights: this build (lanes layout where the
CPU takes it) against another quant_linear.c in turns, and a build from before the lanes layout
(no `lanes` argument) given the weights one feature a row."""

from __future__ import annotations

import shutil

import pytest

from radixserve.kernels.native_build import CSRC
from radixserve.kernels.quant_linear import best_path

pytestmark = pytest.mark.skipif(best_path() is None, reason="no C compiler here")


def test_against_a_build_with_and_without_the_lanes_argument(real_model_dir, tmp_path, capsys):
    from bench import bench_quant_step

    same, older = tmp_path / "same", tmp_path / "older"
    for folder in (same, older):  # the headers quant_linear.c includes, beside each copy
        folder.mkdir()
        for header in CSRC.glob("*.h"):
            shutil.copy(header, folder / header.name)
    shutil.copy(CSRC / "quant_linear.c", same / "quant_linear.c")
    source = (CSRC / "quant_linear.c").read_text()
    # the same kernels behind the signature from before the lanes layout
    source = source.replace("int64_t half, int64_t lanes, const float *bias", "int64_t half, const float *bias")
    source = source.replace("const QWeight w = {codes, scale, offset, N, K, bits, group, zero, half, lanes};\n"
                            "    if (!weight_valid(&w) || M <= 0 || (lanes && path != 0)) return -1;",
                            "const int64_t lanes = 0;\n    const QWeight w = {codes, scale, offset, N, K, bits, group, "
                            "zero, half, lanes};\n    if (!weight_valid(&w) || M <= 0) return -1;")
    assert "int64_t lanes, const float *bias" not in source and "const int64_t lanes = 0;" in source
    (older / "quant_linear.c").write_text(source)
    for against in (same, older):
        assert bench_quant_step.main(["--rows", "2", "--reps", "1", "--against", str(against / "quant_linear.c")]) == 0
        out = capsys.readouterr().out
        assert out.count("this / against") == 2 and "rows   2 layers" in out and "rows   2   head" in out
