"""Prefix cache over the block allocator: a reused block always holds the tokens its hash
names (hypothesis state machine with a shadow of what every block physically holds)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from research.kv.block_allocator import BlockManager, OutOfBlocksError
from research.kv.prefix_cache import PrefixCache, chain_hashes

BS = 4


def _write(shadow, manager, seq, tokens, start):
    """What the device does: tokens[start:] land in the sequence's blocks."""
    for p in range(start, len(tokens)):
        shadow[manager.blocks(seq)[p // BS]][p % BS] = tokens[p]


def _admit(manager, cache, shadow, tokens):
    """The engine's admission: adopt the longest cached prefix, compute the rest."""
    blocks = cache.match(tokens)
    for i, b in enumerate(blocks):  # THE property: a hit holds the tokens its hash names
        assert shadow[b] == list(tokens[i * BS:(i + 1) * BS])
        assert cache.tokens_of(b) == tuple(tokens[i * BS:(i + 1) * BS])
    n_cached = min(len(blocks) * BS, len(tokens) - 1)
    blocks = blocks[:-(-n_cached // BS)] if n_cached else []
    seq = manager.adopt(blocks, n_cached) if blocks else manager.new_sequence()
    n = len(tokens) - n_cached
    need = manager.fresh_blocks_needed({seq: n})
    short = need - manager.allocator.n_free
    if short > 0:
        cache.evict(short)
    try:
        copies = manager.reserve({seq: n})
    except OutOfBlocksError:
        manager.free(seq)
        return None
    for src, dst in copies:  # copy-on-write of a shared partial block
        shadow[dst] = list(shadow[src])
    _write(shadow, manager, seq, tokens, n_cached)
    cache.insert(tokens, manager.blocks(seq), manager.length(seq))
    return seq


ops = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.lists(st.integers(0, 2), min_size=1, max_size=18)),
    st.tuples(st.just("free"), st.integers(0, 10)),
    st.tuples(st.just("evict"), st.integers(0, 4))), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_reused_blocks_hold_the_tokens_their_hash_names(program):
    manager = BlockManager(n_blocks=12, block_size=BS, max_blocks_per_seq=5)
    cache = PrefixCache(manager.allocator, BS)
    shadow = {b: [None] * BS for b in range(12)}
    live = []
    for op, arg in program:
        if op == "admit":
            seq = _admit(manager, cache, shadow, arg)
            if seq is not None:
                live.append(seq)
        elif op == "free" and live:
            manager.free(live.pop(arg % len(live)))
        elif op == "evict":
            cache.evict(arg)
        manager.allocator.check_consistency()
        for h_block in list(range(12)):
            if h_block in cache:
                assert shadow[h_block] == list(cache.tokens_of(h_block))
                assert manager.allocator.refcount(h_block) >= 1
    for seq in live:
        manager.free(seq)
    cache.clear()
    assert manager.allocator.n_used == 0 and len(cache) == 0


def test_chain_hash_names_the_whole_prefix():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = chain_hashes([9, 9, 9, 9, 5, 6, 7, 8], BS)
    assert len(a) == 2 and a[1] != b[1]  # same block tokens, different prefix
    assert chain_hashes([1, 2, 3], BS) == []  # partial blocks are never named


def test_lru_eviction_spares_referenced_blocks():
    manager = BlockManager(n_blocks=6, block_size=BS, max_blocks_per_seq=3)
    cache = PrefixCache(manager.allocator, BS)
    seqs = []
    for first in (1, 2, 3):
        s = manager.new_sequence()
        manager.reserve({s: 8})
        cache.insert([first] * 8, manager.blocks(s), 8)
        seqs.append(s)
    manager.free(seqs[0])
    manager.free(seqs[1])  # seqs[2] stays live: its blocks are not evictable
    assert cache.n_evictable == 4
    cache.match([2] * 8)  # refresh sequence 2's blocks: sequence 1's are now the LRU
    assert cache.evict(2) == 2
    assert cache.match([1] * 8) == [] and len(cache.match([2] * 8)) == 2
    assert cache.evict(10) == 2  # only sequence 2's remain evictable
    assert len(cache.match([3] * 8)) == 2  # live blocks survive
    assert manager.allocator.n_used == 2


def test_adopt_validates():
    manager = BlockManager(n_blocks=4, block_size=BS, max_blocks_per_seq=2)
    with pytest.raises(ValueError, match="free block"):
        manager.adopt([0], 3)
    s = manager.new_sequence()
    manager.reserve({s: 4})
    with pytest.raises(ValueError, match="needs 2 blocks"):
        manager.adopt(list(manager.blocks(s)), 5)
    t = manager.adopt(list(manager.blocks(s)), 3)
    assert manager.allocator.refcount(manager.blocks(s)[0]) == 2
    assert manager.append(t, 1) != []  # writing into the shared partial block copies it
    np.testing.assert_equal(manager.length(t), 4)
