import pytest

from radixserve.core.block_pool import BlockPool


def test_allocate_takes_lowest_free_ids_in_order():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free == 1
    assert pool.ref_counts == [1, 1, 1, 0]
    pool.check_integrity([1, 1, 1, 0])


def test_free_returns_blocks_in_given_order_only_at_zero_refs():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.share([1, 2])
    assert pool.free(reversed(blocks)) == 2  # blocks 3 and 0 reach zero; 1 and 2 still shared
    assert pool.allocate(2) == [3, 0]  # tail first came back first
    assert pool.free([1, 2]) == 2
    pool.check_integrity([1, 0, 0, 1])


def test_allocate_beyond_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(MemoryError):
        pool.allocate(2)
    pool.check_integrity([1, 0])


def test_double_free_and_share_of_free_block_raise():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])
    with pytest.raises(RuntimeError, match="share of free block"):
        pool.share([b])


def test_integrity_detects_holder_mismatch():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(AssertionError, match="ref counts differ"):
        pool.check_integrity([1, 0, 0])
    pool.ref_counts[2] = 1  # a referenced block that is still on the free list
    with pytest.raises(AssertionError, match="in free list"):
        pool.check_integrity()
