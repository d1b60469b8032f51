"""Block allocator / manager: reference counting, copy-on-write, out-of-blocks (property tests)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from research.kv.block_allocator import BlockAllocator, BlockManager, OutOfBlocksError


def test_allocator_frees_exactly_at_zero_refs():
    a = BlockAllocator(4)
    b = a.allocate()
    a.incref(b)
    assert not a.decref(b) and a.refcount(b) == 1 and a.n_free == 3
    assert a.decref(b) and a.n_free == 4
    with pytest.raises(ValueError, match="double free"):
        a.decref(b)
    with pytest.raises(ValueError, match="incref of free block"):
        a.incref(b)


def test_allocator_rejects_bad_ids_and_sizes():
    with pytest.raises(ValueError, match="n_blocks"):
        BlockAllocator(0)
    with pytest.raises(ValueError, match="outside"):
        BlockAllocator(2).decref(5)


def test_fork_shares_blocks_and_copies_only_partial_last_block():
    m = BlockManager(n_blocks=8, block_size=4, max_blocks_per_seq=4)
    parent = m.new_sequence()
    assert m.append(parent, 6) == []  # blocks: [full, partial(2/4)]
    child = m.fork(parent)
    assert m.blocks(child) == m.blocks(parent)
    copies = m.append(child, 1)  # child writes into the shared partial block -> copy it
    assert len(copies) == 1 and copies[0][0] == m.blocks(parent)[1]
    assert m.blocks(child)[0] == m.blocks(parent)[0]  # the full block stays shared
    assert m.blocks(child)[1] == copies[0][1]
    # the parent is now the sole owner of its partial block: it appends in place
    assert m.append(parent, 1) == []


def test_fork_of_block_aligned_sequence_copies_nothing():
    m = BlockManager(n_blocks=8, block_size=4, max_blocks_per_seq=4)
    s = m.new_sequence()
    m.append(s, 8)
    c = m.fork(s)
    assert m.append(c, 3) == [] and m.append(s, 3) == []
    assert m.blocks(c)[:2] == m.blocks(s)[:2] and m.blocks(c)[2] != m.blocks(s)[2]


def test_out_of_blocks_is_an_error_and_changes_nothing():
    m = BlockManager(n_blocks=3, block_size=4, max_blocks_per_seq=8)
    a, b = m.new_sequence(), m.new_sequence()
    m.append(a, 8)
    before = (m.blocks(a), m.length(a), m.allocator.n_free)
    with pytest.raises(OutOfBlocksError, match="need 2 free KV blocks"):
        m.reserve({a: 1, b: 1})  # a needs 1, b needs 1, only 1 free
    assert (m.blocks(a), m.length(a), m.allocator.n_free) == before
    assert m.length(b) == 0 and m.blocks(b) == ()
    m.free(a)  # preempt a, then b fits
    assert m.append(b, 5) == [] and m.allocator.n_free == 1


def test_batch_reserve_counts_cow_exactly():
    """k sharers of one partial block appending together need only k-1 copies."""
    m = BlockManager(n_blocks=4, block_size=4, max_blocks_per_seq=2)
    p = m.new_sequence()
    m.append(p, 2)
    kids = [m.fork(p) for _ in range(3)]  # 4 holders of one partial block, 3 free blocks
    copies = m.reserve({s: 1 for s in [p] + kids})
    assert len(copies) == 3 and m.allocator.n_free == 0
    m.allocator.check_consistency()


def test_bad_requests_raise_clear_errors():
    m = BlockManager(n_blocks=4, block_size=4, max_blocks_per_seq=2)
    s = m.new_sequence()
    with pytest.raises(ValueError, match="max_len=8"):
        m.append(s, 9)
    with pytest.raises(ValueError, match="n_tokens"):
        m.append(s, -1)
    with pytest.raises(ValueError, match="unknown or freed"):
        m.fork(99)
    m.append(s, 3)
    with pytest.raises(ValueError, match="truncate length"):
        m.truncate(s, 4)
    m.free(s)
    with pytest.raises(ValueError, match="unknown or freed"):
        m.free(s)


# -- property test: a random program of fork/append/truncate/free never leaks ------------
OPS = st.lists(st.tuples(st.sampled_from(["new", "fork", "append", "truncate", "free"]),
                         st.integers(0, 10**6), st.integers(0, 9)), max_size=60)


class Shadow:
    """Reference model: each sequence's token contents as a plain list."""

    def __init__(self):
        self.tokens: dict[int, list[int]] = {}


def _apply(m: BlockManager, shadow: Shadow, pool: np.ndarray, op, pick, n, counter):
    live = m.live_sequences()
    if op == "new" or not live:
        shadow.tokens[m.new_sequence()] = []
        return
    seq = live[pick % len(live)]
    if op == "fork":
        shadow.tokens[m.fork(seq)] = list(shadow.tokens[seq])
    elif op == "append":
        try:
            copies = m.append(seq, n)
        except OutOfBlocksError:
            return
        except ValueError:  # would exceed max_len: rejected, nothing changes
            return
        for src, dst in copies:
            pool[dst] = pool[src]
        start = len(shadow.tokens[seq])
        blocks = m.blocks(seq)
        for i in range(n):
            pos = start + i
            counter[0] += 1
            pool[blocks[pos // m.block_size], pos % m.block_size] = counter[0]
            shadow.tokens[seq].append(counter[0])
    elif op == "truncate":
        keep = pick % (len(shadow.tokens[seq]) + 1)
        m.truncate(seq, keep)
        del shadow.tokens[seq][keep:]
    elif op == "free":
        m.free(seq)
        del shadow.tokens[seq]


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(1, 5), st.integers(4, 24))
def test_random_programs_never_leak_double_free_or_corrupt(ops, block_size, n_blocks):
    m = BlockManager(n_blocks=n_blocks, block_size=block_size, max_blocks_per_seq=6)
    shadow, counter = Shadow(), [0]
    pool = np.zeros((n_blocks, block_size), np.int64)  # a fake device pool of token ids
    for op, pick, n in ops:
        _apply(m, shadow, pool, op, pick, n, counter)
        m.allocator.check_consistency()
        # every live sequence reads back exactly what was written to it
        for seq, toks in shadow.tokens.items():
            blocks = m.blocks(seq)
            assert len(blocks) == -(-len(toks) // block_size)
            got = [pool[blocks[p // block_size], p % block_size] for p in range(len(toks))]
            assert got == toks
        # reference counts equal the number of tables holding each block
        held = np.zeros(n_blocks, int)
        for seq in shadow.tokens:
            for b in m.blocks(seq):
                held[b] += 1
        assert all(held[b] == m.allocator._refcount[b] for b in range(n_blocks))
    for seq in list(shadow.tokens):
        m.free(seq)
    assert m.allocator.n_free == n_blocks  # nothing leaked
