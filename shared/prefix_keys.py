"""The prefix cache's keys: a SHA-256 chain over a prompt's full blocks, rooted in its salt.

The scheduler keys its cached blocks with them; the api routes by the same chain, so that
requests that would share cached blocks go to the engine that holds them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

ROOT = b""  # the parent key of a first block, for requests without a salt
ROUTING_BLOCKS = 8  # the blocks of a prompt that key its routing: 128 tokens at the default block size
ROUTING_KEY_BYTES = 8  # as engines report the routing keys their caches hold
KEY_BYTES = 32  # a block's key: a SHA-256 digest


def salted_root(cache_salt: str, adapter: str = "") -> bytes:
    """The chain's root for a salt and a LoRA adapter: requests of different salts, or under different
    adapters (or one and the base model), share no block."""
    root = hashlib.sha256(b"cache_salt\0" + cache_salt.encode()).digest() if cache_salt else ROOT
    return hashlib.sha256(b"lora\0" + adapter.encode() + b"\0" + root).digest() if adapter else root


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A full block's key: SHA-256 over its parent's key and its token ids.

    A cryptographic chain, so that no crafted prompt can take the key of another prompt's prefix
    (Python's hash() of integers can be collided at will); the pool still compares the block's
    own tokens on a hit."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def block_keys(
    root: bytes, token_ids: Sequence[int], block_size: int, num_blocks: int
) -> Iterator[tuple[int, bytes, tuple[int, ...]]]:
    """(index, key, tokens) of the first `num_blocks` full blocks of `token_ids`, chained from `root`."""
    key = root
    for index in range(min(num_blocks, len(token_ids) // block_size)):
        chunk = tuple(token_ids[index * block_size : (index + 1) * block_size])
        key = chain_key(key, chunk)
        yield index, key, chunk


def prefix_key(
    token_ids: Sequence[int], block_size: int, max_blocks: int, cache_salt: str = "", adapter: str = ""
) -> bytes:
    """The key of the prompt's first `max_blocks` full blocks (fewer if it has fewer)."""
    root = salted_root(cache_salt, adapter)
    keys = [key for _, key, _ in block_keys(root, token_ids, block_size, max_blocks)]
    return keys[-1] if keys else root


def routing_key(token_ids: Sequence[int], block_size: int, cache_salt: str = "", adapter: str = "") -> bytes | None:
    """The prefix-cache key of the prompt's first `ROUTING_BLOCKS` full blocks (fewer if it has
    fewer); None for a prompt shorter than a block, which shares nothing."""
    if len(token_ids) < block_size:
        return None
    return prefix_key(token_ids, block_size, ROUTING_BLOCKS, cache_salt, adapter)
