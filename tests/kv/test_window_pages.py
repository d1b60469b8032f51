"""Host bookkeeping of window pages (research/kv/window_pages.py): which blocks get one, how
many a long sequence holds, copies, frees, prefix hits, and refusals."""
import numpy as np
import pytest

from research.kv.block_allocator import BlockManager, OutOfBlocksError
from research.kv.window_pages import WindowPages

BS = 4


def _setup(n_pages=16, sink=2, recent=6, n_blocks=64):
    manager = BlockManager(n_blocks, BS, 32)
    return manager, WindowPages(manager, n_pages, sink=sink, recent=recent)


def _pass(manager, pages, seq, n):
    """Reserve n tokens of `seq` and map its window table for that pass."""
    start = manager.length(seq)
    manager.reserve({seq: n})
    table = manager.block_table([seq])
    return table, pages.pass_table(table, np.array([start]), np.array([n]))


def test_a_long_sequence_holds_a_bounded_number_of_pages():
    manager, pages = _setup()
    seq = manager.new_sequence()
    _pass(manager, pages, seq, 10)  # a prefill chunk, then one token at a time
    most = 0
    for _ in range(90):
        table, window = _pass(manager, pages, seq, 1)
        most = max(most, pages.pages.n_used)
        length = manager.length(seq)
        mapped = {j for j in range(table.shape[1]) if window[0, j] >= 0}
        # the sink's block, the blocks read in full precision, the block written
        assert mapped == pages.read_blocks(length - 1) | pages.write_blocks(length - 1, length)
        pages.check_consistency()
    # sink block + blocks of the last W + a rollback block of slack + the one written
    assert most <= 1 + -(-6 // BS) + 2 + 1
    manager.free(seq)
    assert pages.pages.n_used == 0  # freeing the blocks frees their pages
    pages.check_consistency()


def test_reading_a_block_without_its_page_is_an_error_not_a_stale_read():
    manager, pages = _setup()
    seq = manager.new_sequence()
    manager.reserve({seq: 12})  # written without window pages (never through a pass)
    table = manager.block_table([seq])
    manager.reserve({seq: 1})
    with pytest.raises(RuntimeError, match="no window page"):
        pages.pass_table(manager.block_table([seq]), np.array([12]), np.array([1]))
    del table


def test_copies_and_forks_share_or_copy_pages():
    manager, pages = _setup()
    seq = manager.new_sequence()
    _pass(manager, pages, seq, 10)  # blocks 0, 1, 2 (partial) with pages
    child = manager.fork(seq)  # shares blocks, so their pages
    copies = manager.reserve({child: 1})  # copy-on-write of the partial last block
    window_copies = pages.copy(copies)
    assert len(window_copies) == 1
    src, dst = copies[0]
    assert window_copies[0] == (pages.page_of[src], pages.page_of[dst])
    pages.check_consistency()
    manager.free(seq)
    manager.free(child)
    assert pages.pages.n_used == 0


def test_a_prefix_is_usable_as_far_as_its_pages_exist():
    manager, pages = _setup()
    seq = manager.new_sequence()
    _pass(manager, pages, seq, 8)
    for _ in range(40):
        _pass(manager, pages, seq, 1)
    blocks = manager.blocks(seq)  # 48 tokens: the pages of blocks 1-8 were swept
    # a hit of 24 tokens is cut to the sink block's 4 (candidates: 24, 20, ..., the first
    # whose full-precision reads all have pages)
    assert pages.usable_prefix(blocks, 24) == 4
    assert pages.usable_prefix(blocks, 48) == 48  # its own window: pages still there


def test_out_of_pages_is_a_clear_error():
    manager, pages = _setup(n_pages=2)
    seq = manager.new_sequence()
    with pytest.raises(OutOfBlocksError, match="window pages are in use"):
        _pass(manager, pages, seq, 16)
    with pytest.raises(ValueError, match="already reports frees"):
        WindowPages(manager, 4, sink=0, recent=4)
