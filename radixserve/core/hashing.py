"""Chained block hashes: a compact name for every block-aligned prefix of a token sequence.

hash(block i) = xxh64(hash(block i-1) || token ids of block i), seeded by the cache salt
for block 0, so equal hashes mean equal prefixes (up to a 64-bit collision) within one
namespace. The scheduler uses them to see which prefixes are being computed right now.
"""

from __future__ import annotations

from array import array

import xxhash


def salt_seed(salt: str | None) -> int:
    return 0 if not salt else xxhash.xxh64_intdigest(salt.encode())


def extend_block_hashes(hashes: list[int], tokens: list[int], block_size: int, salt: str | None) -> list[int]:
    """Append the hashes of the full blocks of `tokens` that `hashes` does not cover yet."""
    prev = hashes[-1] if hashes else salt_seed(salt)
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        data = prev.to_bytes(8, "little") + array("q", tokens[start:start + block_size]).tobytes()
        prev = xxhash.xxh64_intdigest(data)
        hashes.append(prev)
    return hashes
