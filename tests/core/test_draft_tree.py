"""core/draft_tree.py: a draft tree's layout, the path verification accepted, the K/V moves."""

from __future__ import annotations

import pytest

from radixserve.core import draft_tree


def test_layout_of_a_tree():
    parents = [-1, 0, -1, 1, 2, 0]
    assert draft_tree.depths(parents) == [0, 1, 0, 2, 1, 1]
    assert draft_tree.ancestor_masks(parents) == [0b1, 0b11, 0b100, 0b1011, 0b10100, 0b100001]
    assert draft_tree.children(parents) == {-1: [0, 2], 0: [1, 5], 1: [3], 2: [4]}
    assert draft_tree.is_chain([-1, 0, 1]) and draft_tree.is_chain([]) and not draft_tree.is_chain(parents)
    assert draft_tree.chain(3) == [-1, 0, 1]


def test_accepted_path_and_its_moves():
    tokens, parents = [7, 8, 9, 4, 5], [-1, 0, -1, 2, 3]
    assert draft_tree.accepted_path(tokens, parents, [7, 8, 1]) == [0, 1]  # the main chain: no move
    assert draft_tree.moves([0, 1]) == []
    assert draft_tree.accepted_path(tokens, parents, [9, 4, 5, 6]) == [2, 3, 4]  # the side branch
    assert draft_tree.moves([2, 3, 4]) == [(2, 0), (3, 1), (4, 2)]
    assert draft_tree.accepted_path(tokens, parents, [3]) == []


def test_check_refuses_what_is_not_a_tree():
    draft_tree.check([1, 2, 3], [-1, 0, 0])
    with pytest.raises(ValueError, match="parent"):
        draft_tree.check([1, 2], [-1, 1])
    with pytest.raises(ValueError, match="sibling"):
        draft_tree.check([1, 2, 2], [-1, 0, 0])
    with pytest.raises(ValueError, match="at most"):
        draft_tree.check([1] * 65, list(range(-1, 64)))
