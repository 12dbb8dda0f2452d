"""CpuShare: how many threads a step's parallel work gets, sized to the cores this process gets.

An agent's tools (compilers, test suites, browsers) run on the machine that serves its model.
A step's parallel regions (hundreds of them: every matmul, norm and attention call) split
their work evenly over a team of threads and end in a barrier, so a region takes as long as
its slowest thread. Once another process takes a core, one team thread is descheduled for a
scheduler slice at a time and every region waits for it: with two threads on two cores and
one CPU-bound neighbour, a step took many times its quiet time. A team no larger than the
cores left over has no thread to wait for.

So each step runs inside `step_team()`, which asks `threads()`: the usable cores (the affinity
mask, capped by a cgroup CPU quota) less the cores other processes used on them lately,
measured from /proc/stat against this process's own CPU time every `interval_s`. A drop
applies at once; a rise only once two samples in a row allow it, so a neighbour that
pauses for an instant does not make the team grow and shrink each step. A window that spans
a pause in stepping (idle_reset_s or more without a step) is not judged: it mostly measures
what ran while the engine had nothing to do, such as the tool an agent ran before sending
its next request, which is done by the time the request comes; a new window starts with
the step. With `fixed` set (--num-threads) nothing is measured.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.kernels.openmp_pool import set_team_size, team_size

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 0.25
IDLE_RESET_S = 0.25  # no step for this long: the next step starts a new window (module docstring)
# Others' load below this many cores does not take a team thread away: short bursts (the
# client's own process, the kernel's work) should not halve a step's parallelism.
IDLE_SLACK_CORES = 0.3
_STAT = "/proc/stat"
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (guest is inside user)
_ALL_FIELDS = 8  # ... plus idle, iowait


@dataclass(frozen=True)
class CpuSnapshot:
    """What the share looks like now, for stats and /metrics."""

    usable_cores: int  # the affinity mask's cores, capped by a cgroup CPU quota
    threads: int  # the team size steps use now
    others_cores: float  # cores other processes used on the usable CPUs, lately
    fixed: bool  # --num-threads: not adapted
    reductions: int  # times the team shrank because others took cores


class CpuShare:
    """The team size for the next step; see the module docstring."""

    def __init__(self, fixed: int | None = None, interval_s: float = SAMPLE_INTERVAL_S,
                 idle_reset_s: float = IDLE_RESET_S, clock: Callable[[], float] = time.monotonic):
        self.usable = usable_cores()
        self.fixed = fixed
        self.interval_s = interval_s
        self.idle_reset_s = idle_reset_s
        self._clock = clock
        self._stepped_at: float | None = None  # when the last step_team ended
        self.current = fixed if fixed else self.usable
        self.others = 0.0
        self.reductions = 0
        self._cpus = _affinity()
        self._clock_hz = os.sysconf("SC_CLK_TCK")
        self._last = self._sample() if not fixed else None
        self._last_at = clock()
        self._rise_votes = 0

    def threads(self) -> int:
        """The team size for a step starting now (re-measured at most every interval_s)."""
        if self.fixed or self._last is None:
            return self.current
        now = self._clock()
        if self._stepped_at is not None and now - self._stepped_at >= self.idle_reset_s:
            self._stepped_at = None
            self._restart_window(now)
        elif now - self._last_at >= self.interval_s:
            self._update(now)
        return self.current

    @contextlib.contextmanager
    def step_team(self):
        """The calling (stepping) thread's team sized for one step, its own size given back
        after: a caller stepping an Engine on its own thread keeps its torch thread count."""
        want = self.threads()
        before = team_size()
        if want != before:
            set_team_size(want)
        try:
            yield want
        finally:
            self._stepped_at = self._clock()
            if want != before:
                set_team_size(before)

    def snapshot(self) -> CpuSnapshot:
        return CpuSnapshot(self.usable, self.current, round(self.others, 2), bool(self.fixed), self.reductions)

    def describe(self) -> str:
        if self.fixed:
            return f"steps use {self.fixed} threads (--num-threads) of {self.usable} usable cores"
        return (f"steps use up to {self.usable} threads, one per usable core, fewer while other processes "
                f"take cores (re-measured every {self.interval_s:g}s; --num-threads fixes the count)")

    # ---- measuring ----------------------------------------------------------------

    def _restart_window(self, now: float) -> None:
        """A new sample window from now, the team kept as it is."""
        sample = self._sample()
        if sample is None:
            self._last = None
            return
        self._last, self._last_at = sample, now

    def _update(self, now: float) -> None:
        sample = self._sample()
        if sample is None:
            self._last = None  # /proc/stat unreadable: keep the team as it is from now on
            return
        busy, total, own = (b - a for a, b in zip(self._last, sample))
        self._last, self._last_at = sample, now
        if total <= 0:
            return
        cores_seen = len(self._cpus)
        self.others = max(0.0, (busy - own) / total * cores_seen)
        self._decide(self.team_for(self.others))

    def team_for(self, others: float) -> int:
        """The team size that leaves `others` cores of work its cores (at least one thread)."""
        taken = math.ceil(max(0.0, others - IDLE_SLACK_CORES))
        return max(1, min(self.usable, self.usable - taken))

    def _decide(self, target: int) -> None:
        if target < self.current:
            log.info("other processes use %.2f of %d cores: steps use %d threads (were %d)",
                     self.others, self.usable, target, self.current)
            self.current, self._rise_votes = target, 0
            self.reductions += 1
        elif target > self.current:
            self._rise_votes += 1
            if self._rise_votes >= 2:
                log.info("other processes use %.2f cores: steps use %d threads again", self.others, target)
                self.current, self._rise_votes = target, 0
        else:
            self._rise_votes = 0

    def _sample(self) -> tuple[int, int, int] | None:
        """(busy ticks, all ticks) summed over the usable CPUs, and this process's own CPU ticks."""
        try:
            with open(_STAT, encoding="ascii") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        busy = total = 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in self._cpus:
                continue
            fields = [int(v) for v in rest.split()[:_ALL_FIELDS]]
            busy += sum(fields[i] for i in _BUSY_FIELDS)
            total += sum(fields)
        times = os.times()
        own = round((times.user + times.system) * self._clock_hz)
        return busy, total, own


def usable_cores(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The cores this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    cores = len(_affinity())
    quota = cgroup_quota(cgroup_root)
    return max(1, min(cores, math.ceil(quota))) if quota else max(1, cores)


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def cgroup_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """The cgroup's CPU quota in cores (v2 cpu.max, else v1 cfs), None when unlimited."""
    try:
        with open(f"{root}/cpu.max", encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(f"{root}/cpu/cpu.cfs_quota_us", encoding="ascii") as f:
            quota_us = int(f.read())
        with open(f"{root}/cpu/cpu.cfs_period_us", encoding="ascii") as f:
            period_us = int(f.read())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None
