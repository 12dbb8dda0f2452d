"""One local Ray and one Serve (its controller and HTTP proxy on one port) for every cluster
test file: each file deploys its own Serve app on them and deletes it after its tests; Serve
and Ray stop once, after the last test of this folder."""

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


@pytest.fixture(scope="package")
def serve_port(local_ray) -> int:
    """The port of the one Serve HTTP proxy (radixserve.cluster.app.deploy starts it with the first app)."""
    from ray import serve

    from subprocess_server import free_port

    try:
        yield free_port()
    finally:
        serve.shutdown()
