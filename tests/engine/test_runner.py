from types import SimpleNamespace

from radixserve.execution.runner import _batch_order, _extend_slots
from radixserve.core.plan import ScheduledChunk


def test_slots_follow_the_block_table_across_block_boundaries():
    slots: list[int] = []
    _extend_slots(slots, [7, 2, 9], start=3, end=10, block_size=4)
    # positions 3 | 4 5 6 7 | 8 9  ->  block 7 slot 3 | block 2 slots 0-3 | block 9 slots 0-1
    assert slots == [31, 8, 9, 10, 11, 36, 37]
    _extend_slots(slots, [5], start=0, end=0, block_size=4)
    assert len(slots) == 7


def test_batch_puts_decodes_first_with_prefix_sharers_side_by_side():
    def chunk(name, table, num_tokens):
        return ScheduledChunk(SimpleNamespace(name=name, block_table=table), 0, num_tokens)

    chunks = [
        chunk("prefill", [1, 2], 40),
        chunk("a1", [5, 6, 9], 1),
        chunk("b1", [3, 4, 8], 1),
        chunk("a2", [5, 6, 7], 1),
        chunk("b2", [3, 4], 1),
        chunk("lone", [11], 1),
    ]
    order = [c.request.name for c in sorted(chunks, key=_batch_order)]
    assert order == ["b2", "b1", "a2", "a1", "lone", "prefill"]
