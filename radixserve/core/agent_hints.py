"""AgentHints: what an agent toolkit says about one request (plain Python, validated here).

- priority: admission order (higher first) and eviction bias of the prefix it leaves
  (above 0: held like a ttl_s of EngineConfig.hint_priority_ttl_s; below 0: evicted first).
- latency_sensitivity_s (Dynamo): within one priority, fcfs treats the request as if it
  arrived this many seconds earlier.
- osl: expected output tokens; admission counts them as blocks the request will need.
- ttl_s: after it finishes, the request's prefix is held this long (refreshed by every hit,
  capped by EngineConfig.hint_max_ttl_s), an eviction order, never reserved memory.
- speculative_prefill: the server prefills the next turn's likely prefix after the reply.
- release: when the request finishes, the holds on its prefix and its session end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRIORITY_MIN, PRIORITY_MAX = -1000, 1000
MAX_TTL_S = 7 * 24 * 3600
MAX_LATENCY_SENSITIVITY_S = 3600.0
WARMUP_PRIORITY = PRIORITY_MIN  # a speculative prefill yields to every other request
KINDS = ("priority", "latency_sensitivity", "osl", "ttl", "speculative_prefill", "release")


def _number_in(value: object, low: float, high: float) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and low <= value <= high)


@dataclass(frozen=True)
class AgentHints:
    priority: int = 0
    latency_sensitivity_s: float = 0.0
    osl: int | None = None
    ttl_s: float | None = None
    speculative_prefill: bool = False
    release: bool = False
    warmup: bool = False  # the request is a speculative prefill the server made (not a client field)

    def __post_init__(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or not (
                PRIORITY_MIN <= self.priority <= PRIORITY_MAX):
            raise ValueError(f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {self.priority!r}")
        if not _number_in(self.latency_sensitivity_s, 0.0, MAX_LATENCY_SENSITIVITY_S):
            raise ValueError(f"latency_sensitivity must be in [0, {MAX_LATENCY_SENSITIVITY_S:g}] seconds, "
                             f"got {self.latency_sensitivity_s!r}")
        if self.osl is not None and (isinstance(self.osl, bool) or not isinstance(self.osl, int) or self.osl < 0):
            raise ValueError(f"osl must be a non-negative integer, got {self.osl!r}")
        if self.ttl_s is not None and (not _number_in(self.ttl_s, 0.0, MAX_TTL_S) or self.ttl_s == 0):
            raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S}] seconds, got {self.ttl_s!r}")
        if self.release and self.ttl_s is not None:
            raise ValueError("release and ttl_s contradict each other: give one")

    def kinds(self) -> list[str]:
        """The hints this request gives (for the metrics), in KINDS order."""
        given = (self.priority != 0, self.latency_sensitivity_s > 0, self.osl is not None, self.ttl_s is not None,
                 self.speculative_prefill, self.release)
        return [kind for kind, on in zip(KINDS, given) if on]

    def queue_key(self, arrival_time: float) -> tuple[int, float]:
        """Sort key in the waiting queue: higher priority first, then the shifted arrival."""
        return -self.priority, arrival_time - self.latency_sensitivity_s


NO_HINTS = AgentHints()
