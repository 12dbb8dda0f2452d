"""One local Ray for every cluster test file: each file deploys its own Serve app on it and
shuts Serve down after its tests; Ray itself stops once, after the last test of this folder."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")  # package: __init__.py makes this folder one, so Ray stops after it
def local_ray():
    ray = pytest.importorskip("ray", reason="the cluster tests need Ray Serve")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
