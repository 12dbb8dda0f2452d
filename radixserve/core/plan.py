"""StepPlan: what the scheduler hands the runner for one forward pass: the scheduled chunks
(a request, the span of its tokens to compute, any draft), the requests preempted and the recurrent-state
snapshot operations to apply first; no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.core.request import Request


@dataclass
class ScheduledChunk:
    """Request computes tokens [start, start + num_tokens) of its token_ids this step."""

    request: Request
    start: int
    num_tokens: int
    # Speculative tokens proposed after the request's last token: the chunk computes
    # token_ids[start:] followed by these (num_tokens counts both), and the step verifies them.
    draft: list[int] = field(default_factory=list)
    # A draft tree (core/draft_tree.py): each draft token's parent among them, -1 the request's
    # last token; empty: the draft is a chain.
    draft_parents: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """The chunk reaches the last token, so the step samples the request's next token
        (unless the request is prefill-only: max_tokens=0 samples nothing)."""
        return (
            self.start + self.num_tokens - len(self.draft) == self.request.num_tokens
            and not self.request.params.prefill_only
        )

    @property
    def decodes(self) -> bool:
        """The chunk computes only the request's last token (plus any draft)."""
        return self.num_tokens - len(self.draft) == 1 and self.samples


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # a recurrent model's state snapshots to save, restore and drop before the forward pass,
    # in order (core/recurrent_snapshots.py's SnapshotOp; the runner's RecurrentStatePool applies them)
    snapshot_ops: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)
