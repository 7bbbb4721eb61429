"""The block allocator and its prefix cache (no model: pure bookkeeping)."""

from __future__ import annotations

import random

import pytest

from stoic.scheduler import BlockAllocator, OutOfBlocks, block_hashes


def _hashes(tokens: list[int], count: int, block_size: int = 4) -> tuple[bytes, ...]:
    return block_hashes(tokens, block_size, count, [])


def test_equal_prefixes_hash_equal_and_any_difference_changes_every_later_hash() -> None:
    """Block hashes chain: block i's hash depends on every token before its end."""
    a = list(range(12))
    b = [*range(5), 99, *range(6, 12)]  # differs in block 1 only
    ha, hb = _hashes(a, 3), _hashes(b, 3)
    assert ha[0] == hb[0]
    assert ha[1] != hb[1] and ha[2] != hb[2]
    assert _hashes(a, 2) == ha[:2]
    known: list[bytes] = []
    assert block_hashes(a, 4, 1, known) == ha[:1]
    assert block_hashes(a, 4, 3, known) == ha, "extending a known chain gives the same hashes"


def test_a_committed_prefix_is_shared_and_reference_counted() -> None:
    """A second sequence with the same prefix shares the committed blocks; freeing one owner keeps
    them in use, freeing both leaves them cached (evictable), not free."""
    alloc = BlockAllocator(8)
    tokens = list(range(10))
    alloc.grow(1, 3)
    assert alloc.commit(1, 0, _hashes(tokens, 2)) == 2
    assert alloc.match(2, _hashes(tokens, 2)) == 2
    assert alloc.table(2) == alloc.table(1)[:2]
    alloc.grow(2, 3)
    assert alloc.table(2)[2] != alloc.table(1)[2], "the unshared tail gets its own block"
    alloc.check_invariant()
    alloc.free(1)
    assert alloc.used_blocks == 3  # sequence 2's three blocks
    alloc.check_invariant()
    alloc.free(2)
    assert alloc.used_blocks == 0 and alloc.free_blocks == 8 and alloc.cached_blocks == 2
    alloc.check_invariant()
    assert alloc.match(3, _hashes(tokens, 2)) == 2, "cached blocks outlive their sequences"
    alloc.check_invariant()


def test_match_stops_at_the_first_uncached_block() -> None:
    """Only a leading run of cached blocks is shared; a sequence with blocks shares nothing."""
    alloc = BlockAllocator(8)
    tokens = list(range(12))
    alloc.grow(1, 3)
    alloc.commit(1, 0, _hashes(tokens, 1))
    other = [*range(4), 50, 51, 52, 53, *range(8, 12)]
    assert alloc.match(2, _hashes(other, 3)) == 1
    assert alloc.match(2, _hashes(tokens, 1)) == 0, "a sequence with blocks already matches nothing"
    assert alloc.match(3, _hashes([7, 7, 7, 7], 1)) == 0 and alloc.table(3) == ()
    alloc.check_invariant()


def test_cached_blocks_are_evicted_least_recently_used_only_when_none_is_free() -> None:
    """Allocation takes free blocks first, then the least recently released cached block, whose
    hash is forgotten so that no later sequence can match stale contents."""
    alloc = BlockAllocator(4)
    first, second = [1, 1, 1, 1], [2, 2, 2, 2]
    for seq_id, tokens in ((1, first), (2, second)):
        alloc.grow(seq_id, 1)
        alloc.commit(seq_id, 0, _hashes(tokens, 1))
    alloc.free(1)
    alloc.free(2)
    alloc.grow(3, 2)  # the two never-used blocks
    assert alloc.evictions == 0 and alloc.cached_blocks == 2
    alloc.grow(4, 1)  # must evict: the least recently freed is sequence 1's block
    assert alloc.evictions == 1
    assert alloc.match(5, _hashes(first, 1)) == 0
    assert alloc.match(6, _hashes(second, 1)) == 1
    alloc.check_invariant()
    with pytest.raises(OutOfBlocks):
        alloc.grow(7, 1)  # every block is now held
    alloc.check_invariant()


def test_a_hash_computed_twice_keeps_its_first_block() -> None:
    """Two sequences computing the same prefix at once: the second commit is a no-op."""
    alloc = BlockAllocator(4)
    tokens = [3, 3, 3, 3]
    alloc.grow(1, 1)
    alloc.grow(2, 1)
    assert alloc.commit(1, 0, _hashes(tokens, 1)) == 1
    assert alloc.commit(2, 0, _hashes(tokens, 1)) == 0
    alloc.free(2)
    assert alloc.free_blocks == 3 and alloc.cached_blocks == 1, "the duplicate went back free"
    alloc.check_invariant()


def test_free_all_forgets_the_prefix_cache() -> None:
    """After a drop nothing is cached: the tensors holding those keys and values are gone."""
    alloc = BlockAllocator(4)
    alloc.grow(1, 2)
    alloc.commit(1, 0, _hashes(list(range(8)), 2))
    assert alloc.free_all() == 2
    assert alloc.cached_blocks == 0 and alloc.free_blocks == 4
    assert alloc.match(2, _hashes(list(range(8)), 2)) == 0
    alloc.check_invariant()


def test_random_operations_keep_every_block_accounted_for() -> None:
    """A seeded random mix of match/grow/commit/free/free_all never breaks the invariant, and an
    allocation that does not fit changes nothing."""
    rng = random.Random(0)
    alloc = BlockAllocator(12)
    prompts = [[rng.randrange(3) for _ in range(16)] for _ in range(4)]
    owner: dict[int, list[int]] = {}
    live: set[int] = set()

    def snapshot(extra: int) -> tuple[object, ...]:
        tables = {seq_id: alloc.table(seq_id) for seq_id in live | {extra}}
        return alloc.free_blocks, alloc.cached_blocks, alloc.sequences, tables

    for step in range(2000):
        op = rng.random()
        if op < 0.3:
            seq_id, tokens = step, rng.choice(prompts)
            owner[seq_id] = tokens
            if alloc.match(seq_id, _hashes(tokens, rng.randint(0, 4))):
                live.add(seq_id)
            before = snapshot(seq_id)
            try:
                alloc.grow(seq_id, rng.randint(1, 4))
                live.add(seq_id)
            except OutOfBlocks:
                assert snapshot(seq_id) == before
        elif op < 0.6 and live:
            seq_id = rng.choice(sorted(live))
            n = len(alloc.table(seq_id))
            alloc.commit(seq_id, 0, _hashes(owner[seq_id], n))
        elif op < 0.98 and live:
            seq_id = rng.choice(sorted(live))
            alloc.free(seq_id)
            live.discard(seq_id)
        else:
            alloc.free_all()
            live.clear()
        alloc.check_invariant()
        assert alloc.sequences == len(live)


def test_a_lookup_says_what_sharing_would_take_from_the_free_pool_and_changes_nothing() -> None:
    """``lookup`` reports the leading cached blocks and how many of them nobody holds (sharing
    takes those out of the free pool; a block another table holds costs nothing), without
    changing anything; ``match`` then shares exactly that many."""
    alloc = BlockAllocator(6)
    tokens = list(range(12))
    alloc.grow(1, 3)
    alloc.commit(1, 0, _hashes(tokens, 3))
    alloc.grow(2, 1)
    alloc.commit(2, 0, _hashes([9, 9, 9, 9], 1))
    alloc.free(2)  # its block cached, evictable
    before = (alloc.free_blocks, alloc.cached_blocks, alloc.sequences)
    assert alloc.lookup(_hashes(tokens, 3)) == (3, 0), "held by sequence 1: free to share"
    assert alloc.lookup(_hashes([9, 9, 9, 9, 1, 1, 1, 1], 2)) == (1, 1)
    assert alloc.lookup(_hashes([5] * 8, 2)) == (0, 0)
    assert (alloc.free_blocks, alloc.cached_blocks, alloc.sequences) == before
    alloc.check_invariant()
    assert alloc.match(3, _hashes([9, 9, 9, 9], 1)) == 1
    assert alloc.free_blocks == before[0] - 1
    alloc.check_invariant()


def test_a_block_is_to_be_zeroed_once_per_pool_and_again_after_a_drop() -> None:
    """``grow`` reports the blocks handed out for the first time since the pool was created or
    dropped (their memory is not zeroed yet), each once; ``free_all`` makes every block fresh
    again. A refused ``grow`` changes nothing."""
    alloc = BlockAllocator(4)
    assert alloc.grow(1, 2) == (0, 1)
    alloc.free(1)
    assert alloc.grow(2, 3) == (2,), "blocks 0 and 1 were zeroed already"
    with pytest.raises(OutOfBlocks):
        alloc.grow(3, 2)
    assert alloc.grow(3, 1) == (3,)
    alloc.free_all()
    assert alloc.grow(4, 4) == (0, 1, 2, 3)
    alloc.check_invariant()
