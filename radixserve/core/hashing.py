"""Chained block hashes, the package's one name for a block-aligned prefix of a token sequence.

hash(block i) = xxh3_128(hash(block i-1) || token ids of block i), starting from the
namespace's root hash (0 without a cache salt, else the salt's hash), so equal hashes mean
equal prefixes within one namespace (128 bits: a collision is not a concern). The scheduler
uses them to see which prefixes are being computed right now; the radix cache names every
block it keeps in the second tier by them, on disk too (kv_tier/persist.py).
"""

from __future__ import annotations

from array import array

import xxhash

HASH_BYTES = 16


def root_hash(salt: str | None) -> int:
    """The hash of a namespace's empty prefix."""
    return 0 if not salt else xxhash.xxh3_128_intdigest(salt.encode())


def chain_hashes(parent: int, tokens: list[int], block_size: int, start: int = 0) -> list[int]:
    """The hashes of the whole blocks of tokens[start:], chained on from `parent` (the hash
    of the prefix tokens[:start], which must be block-aligned)."""
    out = []
    for begin in range(start, len(tokens) - block_size + 1, block_size):
        data = parent.to_bytes(HASH_BYTES, "little") + array("q", tokens[begin:begin + block_size]).tobytes()
        parent = xxhash.xxh3_128_intdigest(data)
        out.append(parent)
    return out


def extend_block_hashes(hashes: list[int], tokens: list[int], block_size: int, salt: str | None) -> list[int]:
    """Append the hashes of the full blocks of `tokens` that `hashes` does not cover yet."""
    prev = hashes[-1] if hashes else root_hash(salt)
    hashes.extend(chain_hashes(prev, tokens, block_size, len(hashes) * block_size))
    return hashes
