from radixserve.runner import _extend_slots


def test_slots_follow_the_block_table_across_block_boundaries():
    slots: list[int] = []
    _extend_slots(slots, [7, 2, 9], start=3, end=10, block_size=4)
    # positions 3 | 4 5 6 7 | 8 9  ->  block 7 slot 3 | block 2 slots 0-3 | block 9 slots 0-1
    assert slots == [31, 8, 9, 10, 11, 36, 37]
    _extend_slots(slots, [5], start=0, end=0, block_size=4)
    assert len(slots) == 7
