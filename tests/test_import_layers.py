"""The layering written in pyproject.toml ([tool.importlinter]) holds: `lint-imports` keeps
every contract on the package, and breaks one when a module imports upward."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(package_parent: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_every_import_contract_is_kept():
    done = lint(ROOT, ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout
    for name in ("layers only point down", "core is plain Python", "kernels are the ground floor",
                 "the server never imports the cluster", "no circles"):
        assert f"{name}" in done.stdout


def test_an_upward_import_breaks_the_contracts(tmp_path):
    shutil.copytree(ROOT / "radixserve", tmp_path / "radixserve", ignore=shutil.ignore_patterns("__pycache__"))
    plan = tmp_path / "radixserve" / "core" / "plan.py"
    plan.write_text(plan.read_text() + "\nimport torch  # noqa\n")
    kernels = tmp_path / "radixserve" / "kernels" / "__init__.py"
    kernels.write_text(kernels.read_text() + "\nfrom radixserve.attention import kv_pool  # noqa\n")
    done = lint(tmp_path, tmp_path)
    assert done.returncode != 0
    out = done.stdout
    assert "layers only point down BROKEN" in out
    assert "core is plain Python: no torch, no tensors, nothing above it BROKEN" in out
    assert "kernels are the ground floor: they import no other part of radixserve BROKEN" in out
    assert "the server never imports the cluster KEPT" in out
    assert "radixserve.core.plan -> torch" in out
    assert "radixserve.kernels -> radixserve.attention.kv_pool" in out
