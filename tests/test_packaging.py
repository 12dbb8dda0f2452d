"""The package as a user installs it: `python -m build` makes an sdist and, from it, a wheel
that both carry the C kernels' sources; the wheel installs with --no-deps into a fresh venv
that already sees a torch (the project's, standing in for a GPU machine's CUDA build), and
there `import radixserve` and `radixserve serve --help` work while torch stays the one it was.

The fresh venv is made with --system-site-packages, whose "system" is the base interpreter,
not the project's venv; a .pth line puts the project venv's site-packages after the venv's
own, so torch and the other dependencies come from there (its editable radixserve does
not: .pth files in a directory added that way are not run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "MANIFEST.in", "radixserve")

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """sdist and wheel of a copy of the tracked sources (a build writes build/ and egg-info)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    out = src / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)], timeout=300)
    return out


def test_sdist_and_wheel_carry_the_c_sources(dist):
    c_sources = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "radixserve").rglob("*.c"))
    assert len(c_sources) >= 4, c_sources
    (wheel,) = dist.glob("radixserve-*.whl")
    (sdist,) = dist.glob("radixserve-*.tar.gz")
    names = zipfile.ZipFile(wheel).namelist()
    assert set(c_sources) <= set(names), sorted(set(c_sources) - set(names))
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert set(c_sources) <= members and "pyproject.toml" in members
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    torch_requirements = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: torch")]
    assert torch_requirements == ["Requires-Dist: torch>=2.13"]  # a lower bound, never a pin


def test_sdist_and_wheel_carry_the_builtin_chat_templates(dist):
    from radixserve.model.builtin_template import BUILTIN_NAMES

    templates = sorted(f"radixserve/model/chat_templates/{name}.jinja" for name in BUILTIN_NAMES)
    assert all((ROOT / t).is_file() for t in templates)
    (wheel,) = dist.glob("radixserve-*.whl")
    (sdist,) = dist.glob("radixserve-*.tar.gz")
    assert set(templates) <= set(zipfile.ZipFile(wheel).namelist())
    with tarfile.open(sdist) as tar:
        assert set(templates) <= {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}


def test_wheel_installs_beside_an_existing_torch(dist, tmp_path):
    import torch

    before = (torch.__version__, str(Path(torch.__file__).resolve()))
    venv = tmp_path / "venv"
    # no pip of its own (ensurepip takes seconds): the project's, seen through the .pth, installs into it
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], timeout=180)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip())
    (site / "project_venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    (wheel,) = dist.glob("radixserve-*.whl")
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
          "--quiet", str(wheel)], timeout=300)
    assert not (site / "torch").exists()  # nothing installed a torch of its own

    probe = (
        "import json, importlib.metadata as md, radixserve, torch\n"
        "from packaging.requirements import Requirement\n"
        "req = next(Requirement(r) for r in md.requires('radixserve') if r.startswith('torch'))\n"
        "print(json.dumps({'radixserve': radixserve.__file__, 'torch': [torch.__version__, torch.__file__],\n"
        "                  'satisfied': req.specifier.contains(torch.__version__, prereleases=True)}))\n"
    )
    seen = json.loads(_run([str(python), "-c", probe], cwd=tmp_path).strip().splitlines()[-1])
    assert Path(seen["radixserve"]).resolve().is_relative_to(site.resolve()), seen  # the wheel's copy
    assert (seen["torch"][0], str(Path(seen["torch"][1]).resolve())) == before
    assert seen["satisfied"], seen  # pip would keep this torch: it meets the wheel's requirement
    help_text = _run([str(venv / "bin" / "radixserve"), "serve", "--help"], cwd=tmp_path)
    assert "usage:" in help_text and "--port" in help_text
    assert (torch.__version__, str(Path(torch.__file__).resolve())) == before


def _run(command: list[str], timeout: float = 120, cwd: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    assert done.returncode == 0, f"{command} -> {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout
