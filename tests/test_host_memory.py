"""Host memory: the arenas' pages (`HostArena`) and the pool lent to
activations copied off the device (`PinnedPool`), on pageable memory (the
CPU device); page-locked in tests/test_cuda.py."""

import pytest
import torch

from pager.base.block import align
from pager.engine.host import HostArena, PinnedPool, host_memory

KIB = 1024


def test_growth_chunks_hold_whole_pages_of_the_size_asked():
    """Gradients' and optimizer state's pages come unplanned, most often of
    one size a block: a grown chunk holds a whole number of them, so none
    of its bytes is left over but the free end of the last."""
    arena = HostArena(pin=False, chunk_bytes=1000 * KIB)
    page = 300 * KIB
    for _ in range(12):
        arena.allocate(page)
    assert arena.used_bytes == 12 * page
    # Chunks grow with what is used (1, 1, 2, then 3 pages: `chunk_bytes` holds 3).
    assert [c.numel() // page for c in arena._chunks] == [1, 1, 2, 3, 3, 3]
    assert all(c.numel() % page == 0 for c in arena._chunks)
    assert arena.reserved_bytes - arena.used_bytes == page  # the last chunk's free end


def test_a_page_takes_an_earlier_chunks_tail():
    arena = HostArena(pin=False, chunk_bytes=1000 * KIB)
    pages = [arena.allocate(300 * KIB) for _ in range(5)]  # chunks of 1, 1, 2 pages; the 5th opens one of 3
    pages.append(arena.allocate(800 * KIB))  # a chunk of its own, full
    reserved = arena.reserved_bytes
    pages.append(arena.allocate(500 * KIB))
    assert arena.reserved_bytes == reserved  # no new chunk: the earlier chunk's tail held it
    assert pages[-1].data_ptr() == pages[4].data_ptr() + 300 * KIB
    # Every page its own bytes: writing one changes no other.
    for i, t in enumerate(pages):
        t.fill_(i + 1)
    assert [int(t.float().mean()) for t in pages] == [1, 2, 3, 4, 5, 6, 7]


def test_the_pool_lends_pieces_of_the_layout_asked():
    pool = _pool()
    t = pool.take((4, 6), (1, 4), torch.bfloat16)  # a transposed view's layout
    assert t.shape == (4, 6) and t.stride() == (1, 4) and t.dtype == torch.bfloat16
    src = torch.randn(6, 4).to(torch.bfloat16).t()
    t.copy_(src)
    assert torch.equal(t, src)
    u = pool.take((3,), (1,), torch.float64)
    assert u.data_ptr() >= t.data_ptr() + align(24 * 2)  # past the first piece, aligned


def _pool(marks=None, waits=None):
    """A pageable pool whose reads marks are numbered, and both kept."""
    marks = [] if marks is None else marks
    waits = [] if waits is None else waits

    def mark():
        marks.append(len(marks))
        return marks[-1]

    return PinnedPool(mark, waits.append, pin=False)


def test_a_chunk_is_lent_again_once_all_its_pieces_came_back():
    """... from its start, its writes after the reads of the pieces it lent
    before (marked when its last piece came back, not when it is reused)."""
    marks, waits = [], []
    pool = _pool(marks, waits)
    a = pool.take((1000,), (1,), torch.float32)
    b = pool.take((1000,), (1,), torch.float32)
    reserved = pool.reserved_bytes
    pool.give(a)
    c = pool.take((10,), (1,), torch.float32)
    assert c.data_ptr() > b.data_ptr() and not marks  # b still lent: the chunk goes on from its end
    pool.give(b)
    pool.give(c)
    assert marks == [0] and not waits
    d = pool.take((1000,), (1,), torch.float32)
    assert d.data_ptr() == a.data_ptr() and waits == [0]
    assert pool.reserved_bytes == reserved


@pytest.fixture
def small_chunks(monkeypatch):
    from pager.engine import host

    monkeypatch.setattr(host, "POOL_CHUNK_MIN_BYTES", 256 * KIB)
    monkeypatch.setattr(host, "POOL_CHUNK_MAX_BYTES", 1024 * KIB)


def test_a_training_pass_lends_the_same_memory_each_step(small_chunks):
    """What a forward sends is back in the pool after its backward (last
    first); the next step's pieces come from the same chunks, in the order
    they were made: the pool does not grow for a fixed batch."""
    pool = _pool()
    gen = torch.Generator().manual_seed(0)
    shapes = [(int(n), 256) for n in torch.randint(24, 200, (60,), generator=gen)]  # 24-200 KiB each
    first = None
    for _step in range(3):
        lent = [pool.take(s, (s[1], 1), torch.float32) for s in shapes]
        ptrs = [t.data_ptr() for t in lent]
        for t in reversed(lent):  # the backward brings them back last first
            pool.give(t)
        first = first or (ptrs, pool.reserved_bytes)
        assert (ptrs, pool.reserved_bytes) == first
    assert len(pool._chunks) > 3


def test_a_piece_given_back_while_the_pool_is_busy_is_settled_later():
    """A piece may come back while the pool's lock is held (a garbage
    collection inside `take` ending an activation's life on the same
    thread): it is queued, not waited for, and settled by the next `take`."""
    pool = _pool()
    a = pool.take((100,), (1,), torch.float32)
    with pool._lock:
        pool.give(a)  # (would deadlock with a blocking lock)
    assert pool._returned and pool._current is not None
    b = pool.take((100,), (1,), torch.float32)
    assert b.data_ptr() == a.data_ptr() and not pool._returned


def test_an_empty_piece_comes_back_too():
    pool = _pool()
    e = pool.take((0, 3), (3, 1), torch.float32)
    pool.give(e)
    assert not pool._lent and pool._idle


def test_a_larger_piece_than_any_idle_chunk_gets_a_chunk_of_its_own():
    pool = _pool()
    a = pool.take((16,), (1,), torch.uint8)
    pool.give(a)
    huge = (1 << 27) + 1
    b = pool.take((huge,), (1,), torch.uint8)
    assert b.numel() == huge and pool.reserved_bytes >= huge + (1 << 26)


def test_private_pages_never_take_a_tail_of_the_nodes_shared_file(tmp_path):
    """The node's shared file holds the planned pages (the weights), which
    every rank of the node writes: a page allocated past the plan is never
    cut from a tail of it."""
    arena = HostArena(pin=False)
    arena.reserve([1000])  # (one planned chunk of 1 KiB: a 512-byte page leaves a 512-byte tail)
    arena.share(str(tmp_path / "weights"))
    weights = arena.allocate(100)
    assert arena.is_shared(weights)
    private = arena.allocate(100)  # (a gradients' page, say)
    assert not arena.is_shared(private)


def test_pageable_host_memory_is_what_was_asked():
    t = host_memory(3 * KIB, pin=False)
    assert t.dtype == torch.uint8 and t.numel() == 3 * KIB and not t.is_pinned()
