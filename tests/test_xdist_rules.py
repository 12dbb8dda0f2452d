"""The xdist rules (tests/xdist_rules.py): the lock (each WorkerLock opens its own files, so two in
one process exclude each other as two workers do), then a real `pytest -n 2` run of a small suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from xdist_rules import WorkerLock, torch_threads

WAIT_S = 0.3  # how long a blocked holder is given to (wrongly) get in


def _hold_in_thread(lock: WorkerLock, alone: bool, entered: threading.Event, leave: threading.Event):
    def run():
        with lock.hold(alone):
            entered.set()
            leave.wait(30)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _locks(tmp_path, n):
    return [WorkerLock("run", str(tmp_path)) for _ in range(n)]


def test_tests_that_are_not_serial_run_side_by_side(tmp_path):
    a, b = _locks(tmp_path, 2)
    with a.hold(alone=False):
        entered, leave = threading.Event(), threading.Event()
        thread = _hold_in_thread(b, False, entered, leave)
        assert entered.wait(10)
        leave.set()
        thread.join(10)


def test_a_serial_test_waits_for_the_running_test_and_then_runs_alone(tmp_path):
    a, b, c = _locks(tmp_path, 3)
    serial_in, serial_out = threading.Event(), threading.Event()
    other_in, other_out = threading.Event(), threading.Event()
    with a.hold(alone=False):
        serial = _hold_in_thread(b, True, serial_in, serial_out)
        assert not serial_in.wait(WAIT_S), "the serial test started beside a running test"
        # a test that starts while the serial one waits queues behind it (the turnstile)
        other = _hold_in_thread(c, False, other_in, other_out)
        assert not other_in.wait(WAIT_S)
    assert serial_in.wait(10)
    assert not other_in.wait(WAIT_S), "a test started beside the serial test"
    serial_out.set()
    serial.join(10)
    assert other_in.wait(10)
    other_out.set()
    other.join(10)


def test_a_lock_is_free_again_after_a_failing_test(tmp_path):
    a, b = _locks(tmp_path, 2)
    try:
        with a.hold(alone=True):
            raise RuntimeError("the test failed")
    except RuntimeError:
        pass
    entered, leave = threading.Event(), threading.Event()
    thread = _hold_in_thread(b, True, entered, leave)
    assert entered.wait(10)
    leave.set()
    thread.join(10)


def test_a_serial_test_passes_the_lock_on_to_the_next_serial_test(tmp_path):
    a, b = _locks(tmp_path, 2)
    with a.hold(alone=True, keep=True):
        pass
    entered, leave = threading.Event(), threading.Event()
    other = _hold_in_thread(b, False, entered, leave)
    assert not entered.wait(WAIT_S), "a test started between two serial tests"
    with a.hold(alone=True):  # would wait for the other test, had the lock been released
        assert not entered.is_set()
    assert entered.wait(10)
    leave.set()
    other.join(10)


def test_a_workers_torch_ops_take_its_share_of_the_cores_and_a_serial_test_all():
    assert [torch_threads(False, 2, 2), torch_threads(True, 2, 2)] == [1, 2]
    assert [torch_threads(False, 8, 2), torch_threads(False, 3, 2), torch_threads(False, 1, 2)] == [4, 1, 1]
    assert torch_threads(False, 4, 1) == 4


@pytest.mark.skipif("PYTEST_XDIST_WORKER" not in os.environ, reason="the rule of pytest-xdist workers")
def test_this_workers_torch_ops_take_its_share():
    import torch

    assert torch.get_num_threads() == torch_threads(False)


MODULE = """
import json, os, time
import pytest

LOG = {log!r}


def note(**fields):
    with open(LOG, "a") as f:
        f.write(json.dumps({{"worker": os.environ.get("PYTEST_XDIST_WORKER"), **fields}}) + "\\n")


@pytest.fixture(scope="module")
def started():
    note(setup=__name__)


{serial}
@pytest.mark.parametrize("i", range(6))
def test_one(started, i):
    start = time.monotonic()
    time.sleep(0.1)
    note(module=__name__, start=start, end=time.monotonic(), serial=False)
"""

CONFTEST = """
from xdist_rules import module_scheduler, pytest_runtest_protocol


def pytest_xdist_make_scheduler(config, log):
    return module_scheduler(config, log, {"test_b.py": "b and d", "test_d.py": "b and d"})
"""

# First in test_a: without the lock they would run beside the other worker's first module; the
# second right after the first, with no other test started in between.
SERIAL = """
@pytest.mark.serial
@pytest.mark.parametrize("j", range(2))
def test_alone(j):
    start = time.monotonic()
    time.sleep(0.5)
    note(module=__name__, start=start, end=time.monotonic(), serial=True)

"""


def test_two_workers_keep_modules_whole_share_a_named_worker_and_run_a_serial_test_alone(tmp_path):
    log = tmp_path / "log.jsonl"
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    for name in ("a", "b", "c", "d"):
        body = MODULE.format(log=str(log), serial=SERIAL if name == "a" else "")
        (suite / f"test_{name}.py").write_text(textwrap.dedent(body))
    tests = Path(__file__).resolve().parent
    # xdist alone of the installed plugins (loading them all is most of the three interpreters' start)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "xdist.plugin", "-p", "no:cacheprovider",
         "--rootdir", str(suite), "-c", "/dev/null", str(suite)],
        capture_output=True, text=True, timeout=240, cwd=suite,
        env={**os.environ, "PYTHONPATH": str(tests), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    setups = [r["setup"] for r in rows if "setup" in r]
    assert sorted(setups) == ["test_a", "test_b", "test_c", "test_d"], setups  # each module's fixture once
    ran = [r for r in rows if "module" in r]
    assert len(ran) == 4 * 6 + 2
    for module in ("test_a", "test_b", "test_c", "test_d"):
        assert len({r["worker"] for r in ran if r["module"] == module}) == 1, module  # one worker per module
    assert len({r["worker"] for r in ran}) == 2  # both workers ran tests
    assert {r["worker"] for r in ran if r["module"] == "test_b"} == {r["worker"] for r in ran if r["module"] == "test_d"}
    first, second = sorted((r for r in ran if r["serial"]), key=lambda r: r["start"])
    beside = [r for r in ran if not r["serial"] and r["start"] < second["end"] and first["start"] < r["end"]]
    assert not beside, beside  # neither serial test had another beside it, nor did one start between them
