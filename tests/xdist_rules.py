"""How the suite runs in pytest-xdist workers (`pytest -n 2`), as hooks tests/conftest.py takes in:
each test module on one worker (its module fixtures start once), a test marked `serial` (it
measures wall time) with no other test beside it, and each worker's own torch ops (transformers'
references, reference kernels) on its share of the cores."""

from __future__ import annotations

import fcntl
import functools
import os
import sys
import tempfile
from contextlib import contextmanager

import pytest


class WorkerLock:
    """A readers-writer lock shared by the pytest-xdist workers of one run (`pytest -n 2`).

    Every test holds it shared from its setup to its teardown (fixtures of wider scope included,
    since they are set up inside a test's protocol); a test marked `serial` holds it exclusively,
    so it runs with no other worker's test beside it. The turnstile keeps a waiting `serial` test
    from being starved: a worker takes it before either side, and a serial test keeps it until
    it is done, so the other worker finishes its current test and then waits. A serial test
    followed by another on its worker (`keep`) passes the lock on to it: released in between,
    the other worker would start a test and the next serial one wait for that test to end."""

    def __init__(self, run_id: str, folder: str | None = None) -> None:
        base = os.path.join(folder or tempfile.gettempdir(), f"radixserve-tests-{run_id}")
        self._turnstile = open(base + ".turnstile", "a")
        self._tests = open(base + ".lock", "a")
        self._kept = False  # held alone since the last serial test, for the next one

    @contextmanager
    def hold(self, alone: bool, keep: bool = False):
        if self._kept and not alone:
            self._release(alone=True)
            self._kept = False
        if not self._kept:
            self._acquire(alone)
        self._kept = False
        try:
            yield
        finally:
            if alone and keep:
                self._kept = True
            else:
                self._release(alone)

    def _acquire(self, alone: bool) -> None:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        fcntl.flock(self._tests, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)

    def _release(self, alone: bool) -> None:
        fcntl.flock(self._tests, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)


_worker_lock = WorkerLock(os.environ["PYTEST_XDIST_TESTRUNUID"]) if "PYTEST_XDIST_WORKER" in os.environ else None


@functools.cache
def _usable_cores() -> int:
    from radixserve.engine.cpu_share import usable_cores

    return usable_cores()


def torch_threads(alone: bool, cores: int | None = None, workers: int | None = None) -> int:
    """The torch thread count of a worker's test: the usable cores split over the workers, or all
    of them for a test that runs alone. Two workers of two threads each on two cores leave every
    parallel region waiting on a descheduled thread (transformers' 800-token forward: 10.7 s
    beside another such process, 3.9 s on one thread, 2.0 s on two alone). An Engine sizes its
    own steps' teams by the cores others leave it (radixserve/engine/cpu_share.py) and gives the
    count back after each step."""
    cores = cores or _usable_cores()
    workers = workers or int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return cores if alone else max(1, cores // workers)


# Modules that share one worker, by name: the Ray files share one local Ray (tests/cluster/conftest.py).
SHARED_WORKER = {
    "tests/cluster/test_cluster_ray.py": "local Ray",
    "tests/cluster/test_cluster_pd_ray.py": "local Ray",
    "tests/cluster/test_cluster_kv_events_ray.py": "local Ray",
}


def module_scheduler(config, log, shared: dict[str, str]):
    """xdist's scope scheduling with one scope per test file (or per name in `shared`), taken in
    collection order. (`--dist loadgroup` would do the grouping, but with pytest 9 its marks no
    longer reach the scheduler: it renames `Item._nodeid`, which `Item.nodeid` no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return shared.get(path, path)

    config.option.loadscopereorder = False  # collection order: the long cluster modules start first
    return ModuleScheduling(config, log)


def pytest_xdist_make_scheduler(config, log):
    """`pytest -n 2` (xdist's default `--dist load`): each module on one worker, so its module
    fixtures start once; any other `--dist` asked for is left to xdist."""
    if config.getvalue("dist") != "load":
        return None
    return module_scheduler(config, log, SHARED_WORKER)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, a test marked `serial` (it measures wall time) runs alone, on every
    core; any other test's torch ops take the worker's share of the cores."""
    if _worker_lock is None:
        return (yield)
    alone = _is_serial(item)
    torch = sys.modules.get("torch")  # tests/conftest.py imports it; a suite without torch has nothing to size
    if torch is not None and torch.get_num_threads() != (threads := torch_threads(alone)):
        torch.set_num_threads(threads)  # milliseconds: only when the count changes
    with _worker_lock.hold(alone=alone, keep=nextitem is not None and _is_serial(nextitem)):
        return (yield)


def _is_serial(item) -> bool:
    return item.get_closest_marker("serial") is not None
