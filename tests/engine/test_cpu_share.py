"""CpuShare: the steps' team size follows the cores other processes leave (engine/cpu_share.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from radixserve.engine import cpu_share
from radixserve.engine.cpu_share import CpuShare, cgroup_quota


class FakeMachine:
    """A /proc/stat and os.times() the test advances by hand (ticks at 100 Hz)."""

    def __init__(self, path, cpus: int = 2):
        self.path, self.cpus = path, cpus
        self.busy = [0] * cpus  # per CPU: user ticks (everything busy counts alike)
        self.idle = [0] * cpus
        self.own_ticks = 0
        self.write()

    def advance(self, ticks: int, busy_per_cpu: list[int], own: int) -> None:
        for i, b in enumerate(busy_per_cpu):
            self.busy[i] += b
            self.idle[i] += ticks - b
        self.own_ticks += own
        self.write()

    def write(self) -> None:
        lines = [f"cpu  {sum(self.busy)} 0 0 {sum(self.idle)} 0 0 0 0 0 0"]
        lines += [f"cpu{i} {b} 0 0 {d} 0 0 0 0 0 0" for i, (b, d) in enumerate(zip(self.busy, self.idle))]
        lines += ["intr 1 2 3", "ctxt 55", "procs_running 3"]
        self.path.write_text("\n".join(lines) + "\n")

    def times(self):
        return SimpleNamespace(user=self.own_ticks / 100, system=0.0)


@pytest.fixture
def machine(tmp_path, monkeypatch):
    fake = FakeMachine(tmp_path / "stat")
    monkeypatch.setattr(cpu_share, "_STAT", str(fake.path))
    monkeypatch.setattr(cpu_share.os, "times", fake.times)
    monkeypatch.setattr(cpu_share, "_affinity", lambda: {0, 1})
    monkeypatch.setattr(cpu_share, "cgroup_quota", lambda root="": None)
    monkeypatch.setattr(cpu_share.os, "sysconf", lambda name: 100)
    return fake


def test_team_for_leaves_others_their_cores(machine):
    share = CpuShare(interval_s=0.0)
    assert share.usable == 2
    assert [share.team_for(o) for o in (0.0, 0.2, 0.3, 0.31, 0.67, 1.0, 1.3, 1.31, 2.0)] == [2, 2, 2, 1, 1, 1, 1, 1, 1]
    share.usable = 8
    assert [share.team_for(o) for o in (0.0, 1.0, 1.35, 2.5, 7.9)] == [8, 7, 6, 5, 1]


def test_a_neighbour_shrinks_the_team_at_once_and_it_grows_back_after_two_quiet_samples(machine):
    share = CpuShare(interval_s=0.0)
    assert share.threads() == 2
    # we ran on both cores (own 180 of 200 ticks), others 0: stays at 2
    machine.advance(100, [95, 95], own=180)
    assert share.threads() == 2 and share.others == pytest.approx(0.1)
    # a CPU-bound neighbour took 70 ticks beside our 130: others 0.7 cores -> 1 thread at once
    machine.advance(100, [100, 100], own=130)
    assert share.threads() == 1 and share.others == pytest.approx(0.7) and share.reductions == 1
    # the neighbour stops: one quiet sample is not enough to grow back, two are
    machine.advance(100, [60, 40], own=100)
    assert share.threads() == 1
    machine.advance(100, [60, 40], own=100)
    assert share.threads() == 2 and share.reductions == 1
    # a quiet sample between two busy ones resets the vote
    machine.advance(100, [100, 100], own=100)
    assert share.threads() == 1 and share.reductions == 2
    machine.advance(100, [50, 50], own=100)
    machine.advance(100, [100, 100], own=100)
    machine.advance(100, [50, 50], own=100)
    assert share.threads() == 1
    snap = share.snapshot()
    assert (snap.usable_cores, snap.threads, snap.fixed, snap.reductions) == (2, 1, False, 2)


def test_what_ran_while_the_engine_sat_idle_does_not_shrink_the_next_steps(machine):
    """An agent's tool runs while the engine waits for the agent's next request: a window that
    spans the pause is not judged; one the engine stepped through is."""
    now = [0.0]
    share = CpuShare(interval_s=0.25, idle_reset_s=0.25, clock=lambda: now[0])

    def steps(seconds: float, busy: list[int], own: int) -> list[int]:
        """Back-to-back steps for `seconds` (0.1 s each) while the CPUs see `busy` ticks and we
        `own` of them per step; the team size of each."""
        teams = []
        for _ in range(round(seconds / 0.1)):
            machine.advance(10, busy, own)
            now[0] += 0.1
            with share.step_team() as threads:
                teams.append(threads)
        return teams

    assert steps(0.5, [9, 9], own=18) == [2] * 5
    machine.advance(100, [100, 100], own=0)  # the tool: both cores busy for a second, no step
    now[0] += 1.0
    assert steps(1.0, [9, 9], own=18) == [2] * 10 and share.reductions == 0  # the request after it
    teams = steps(1.0, [10, 10], own=12)  # a neighbour takes 0.8 cores while we step
    assert teams[0] == 2 and teams[-1] == 1 and share.reductions == 1
    machine.advance(100, [100, 100], own=0)  # idle again, the neighbour still running
    now[0] += 1.0
    assert steps(1.0, [10, 10], own=8) == [1] * 10 and share.others == pytest.approx(1.2)


def test_cpus_outside_the_affinity_mask_are_not_counted(tmp_path, monkeypatch):
    fake = FakeMachine(tmp_path / "stat", cpus=4)
    monkeypatch.setattr(cpu_share, "_STAT", str(fake.path))
    monkeypatch.setattr(cpu_share.os, "times", fake.times)
    monkeypatch.setattr(cpu_share, "_affinity", lambda: {0, 1})
    monkeypatch.setattr(cpu_share, "cgroup_quota", lambda root="": None)
    monkeypatch.setattr(cpu_share.os, "sysconf", lambda name: 100)
    share = CpuShare(interval_s=0.0)
    assert share.usable == 2
    fake.advance(100, [100, 100, 100, 100], own=200)  # CPUs 2 and 3 are busy, but not ours
    assert share.threads() == 2 and share.others == pytest.approx(0.0)


def test_a_fixed_count_is_never_measured(machine):
    share = CpuShare(fixed=3, interval_s=0.0)
    machine.advance(100, [100, 100], own=0)
    assert share.threads() == 3 and share.snapshot().fixed
    assert "--num-threads" in share.describe()


def test_an_unreadable_proc_stat_keeps_the_team(machine, monkeypatch):
    share = CpuShare(interval_s=0.0)
    monkeypatch.setattr(cpu_share, "_STAT", "/nonexistent/stat")
    assert share.threads() == 2
    assert share.threads() == 2


@pytest.mark.parametrize("files,cores", [
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_cgroup_quota(tmp_path, files, cores):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_quota(str(tmp_path)) == cores


def test_usable_cores_is_capped_by_the_quota(tmp_path, monkeypatch):
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    monkeypatch.setattr(cpu_share, "_affinity", lambda: {0, 1, 2, 3})
    assert cpu_share.usable_cores(str(tmp_path)) == 1
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cpu_share.usable_cores(str(tmp_path)) == 3


def test_a_step_team_is_the_stepping_threads_own_and_given_back_after(machine):
    """The team size is the calling thread's (libgomp's per-thread setting): torch's ops and
    the C kernels both read it inside the step; after it the thread has its own size again,
    and another thread's is never touched."""
    share = CpuShare(interval_s=0.0)
    seen = {}

    def stepping_thread():
        seen["own"] = torch.get_num_threads()
        machine.advance(100, [100, 100], own=120)  # a neighbour took 0.8 cores
        with share.step_team() as threads:
            seen["inside"] = (threads, torch.get_num_threads())
        seen["after"] = torch.get_num_threads()
        for _ in range(2):  # two quiet samples
            machine.advance(100, [10, 10], own=0)
            with share.step_team() as threads:
                seen["quiet"] = (threads, torch.get_num_threads())

    before = torch.get_num_threads()
    t = threading.Thread(target=stepping_thread)
    t.start()
    t.join()
    own = seen["own"]
    assert seen == {"own": own, "inside": (1, 1), "after": own, "quiet": (2, 2)}
    assert torch.get_num_threads() == before


@pytest.mark.skipif(not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux's /proc/stat and two usable cores")
def test_a_real_cpu_bound_neighbour_is_seen(tmp_path):
    """A busy process pinned to our cores shows as at least most of a core of others' load
    (whatever else runs on the machine only adds to it), and the team shrinks."""
    share = CpuShare(interval_s=0.0)
    hog = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 5\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)
        share.threads()  # starts a sample window with the hog running
        time.sleep(0.6)
        assert share.threads() < share.usable
        assert share.others >= 0.7
    finally:
        hog.kill()
        hog.wait()
