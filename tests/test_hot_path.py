"""The hot path of a streamed use, made cheaper without changing what it
decides: the prefetch frontier ([Note: the prefetch frontier] in
model/prefetch.py). CPU device, bit for bit against the unwrapped model."""

import copy

import pytest
import torch
from helpers import assert_models_equal, assert_same, tensor_page_bytes

import pager
from pager.engine.engine import Engine
from pager.engine.room import Room
from pager.model.prefetch import Frontier


def _stack(n=24, width=32):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(n)])


def _fetches(monkeypatch) -> list:
    """The blocks the engine fetches from now on, in order, by name."""
    order: list = []
    fetch = Engine.fetch

    def recorded(self, block, kinds):
        order.append(block.name)
        return fetch(self, block, kinds)

    monkeypatch.setattr(Engine, "fetch", recorded)
    return order


def _record_evictions(monkeypatch, into: list) -> None:
    """The blocks the engine evicts from now on, added to `into` in order, by name."""
    evict = Engine.evict

    def recorded(self, block, *args, **kwargs):
        into.append(block.name)
        return evict(self, block, *args, **kwargs)

    monkeypatch.setattr(Engine, "evict", recorded)


def _run(model, monkeypatch, frontier: bool, budget: int, train: bool, evicted: list | None = None) -> tuple:
    """Forwards (and steps, with `train`) under `budget`, with the frontier or
    with every walk from the start; a served read of a paged-out block and a
    smaller budget in the middle (both move blocks outside a walk).
    `evicted`: the evictions are added to it, in order."""
    if not frontier:
        monkeypatch.setattr(Frontier, "start", lambda self, scheduler, engine: 0)
    # (updates on the device: on the host, a walk waits for those still running, which the host's timing decides)
    pager.wrap(model, budget=budget, device="cpu", optimizer_step="device")
    order = _fetches(monkeypatch)
    if evicted is not None:
        _record_evictions(monkeypatch, evicted)
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if train else None
    outs = []
    for i in range(8):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(i))
        with torch.set_grad_enabled(train):
            y = model(x)
        if train:
            y.square().mean().backward()
            opt.step()
            opt.zero_grad()
        outs.append(y.detach())
        if i == 3:
            assert_same(model[5][0].weight.sum(), model[5][0].weight.sum())  # (a served read)
        if i == 5:
            pager.of(model).set_budget(budget * 3 // 4)
    stats = pager.of(model).stats()
    pager.unwrap(model)
    monkeypatch.undo()
    return order, outs, (stats.prefetches, stats.misses, stats.evictions)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_a_prefetch_alone_evicts_what_the_general_choice_evicts(monkeypatch, train):
    """A model alone on its engine: its prefetches' room made by the lean
    path (`Room._room_ahead`) evicts and fetches the same blocks in the same
    order as the choice over every owner's blocks (`Room._room_among`)."""
    model = _stack()
    ref = copy.deepcopy(model)
    budget = (8 if not train else 14) * tensor_page_bytes(model[0])
    lean: list = []
    got = _run(model, monkeypatch, frontier=True, budget=budget, train=train, evicted=lean)
    monkeypatch.setattr(Room, "_room_ahead", Room._room_among)
    general: list = []
    want = _run(ref, monkeypatch, frontier=True, budget=budget, train=train, evicted=general)
    assert lean == general and len(lean) > 24
    assert got[0] == want[0] and got[2] == want[2]
    for a, b in zip(got[1], want[1]):
        assert_same(a, b)
    assert_models_equal(model, ref)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_the_frontier_fetches_what_a_walk_from_the_start_fetches(monkeypatch, train):
    """Walks that start at the frontier fetch the same blocks in the same
    order as walks from the next use, through evictions outside the walk (a
    served read, a smaller budget) and optimizer steps between forwards
    (updates deferred to the next forward's first blocks)."""
    model = _stack()
    ref = copy.deepcopy(model)
    layer = tensor_page_bytes(model[0])
    budget = (8 if not train else 14) * layer
    got = _run(model, monkeypatch, frontier=True, budget=budget, train=train)
    want = _run(ref, monkeypatch, frontier=False, budget=budget, train=train)
    assert got[0] == want[0] and len(got[0]) > 24
    assert got[2] == want[2]
    for a, b in zip(got[1], want[1]):
        assert_same(a, b)
    assert_models_equal(model, ref)


def test_the_frontier_moves_on_and_holds_only_while_nothing_left():
    """Once a walk found resident blocks ahead, the next use's walk starts
    past them; a block leaving (here, a smaller budget) sends it back to the
    next use."""
    model = _stack(n=12)
    layer = tensor_page_bytes(model[0])
    pager.wrap(model, budget=10 * layer, device="cpu")
    p = pager.of(model)
    x = torch.randn(4, 32)
    with torch.no_grad():
        for _ in range(3):
            model(x)
    starts = []
    start = Frontier.start

    def seen(self, scheduler, engine):
        starts.append(start(self, scheduler, engine))
        return starts[-1]

    Frontier.start = seen
    try:
        with torch.no_grad():
            model(x)
        assert max(starts) > 1  # (later walks skip the resident blocks the last one saw)
        frontier = p.prefetch_frontier
        before = frontier.start(p.scheduler, p.engine)
        p.set_budget(6 * layer)  # blocks leave outside any walk
        assert p.engine.departures and frontier.start(p.scheduler, p.engine) == 0 <= before
    finally:
        Frontier.start = start
    pager.unwrap(model)


def test_an_update_deferred_to_a_use_resets_the_frontier(monkeypatch):
    """An optimizer step that defers a block's update to its next use
    changes what a walk must fetch for it (its gradients and state too), so
    the frontier is reset for each ([Note: the prefetch frontier]: the walk
    ahead of a backward's last uses reaches into the next forward's first
    blocks, to which the step then defers updates)."""
    model = _stack(n=12)
    layer = tensor_page_bytes(model[0])
    pager.wrap(model, budget=8 * layer, device="cpu", optimizer_step="device")
    p = pager.of(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for first in (True, False):  # (a first step makes the state: only later ones defer)
        opt.zero_grad()
        model(torch.randn(4, 32)).square().mean().backward()
        if first:
            opt.step()
    resets = []
    reset = Frontier.reset
    monkeypatch.setattr(Frontier, "reset", lambda self: (resets.append(1), reset(self)))
    deferred = p.stats().deferred_steps
    opt.step()
    assert p.stats().deferred_steps - deferred == len(resets) > 0
    monkeypatch.undo()
    pager.unwrap(model)


def test_the_frontier_fetches_what_a_walk_from_the_start_fetches_after_a_fetch_out_of_memory(monkeypatch):
    """A fetch that finds the device out of memory evicts every idle block
    (`Engine._allocate`), those before the frontier too: the next walks do
    not skip them."""
    from pager.engine.transport import CpuTransport

    runs = []
    for frontier in (True, False):
        model = _stack()
        layer = tensor_page_bytes(model[0])
        allocate, calls = CpuTransport.allocate, [0]

        def once_out_of_memory(self, flat, nbytes):
            calls[0] += 1
            if calls[0] == 70:  # (a prefetch's, in the third forward)
                raise torch.cuda.OutOfMemoryError("test: the device is full")
            return allocate(self, flat, nbytes)

        monkeypatch.setattr(CpuTransport, "allocate", once_out_of_memory)
        runs.append(_run(model, monkeypatch, frontier=frontier, budget=14 * layer, train=False))
    (order, outs, stats), (want_order, want_outs, want_stats) = runs
    assert order == want_order and stats == want_stats
    for a, b in zip(outs, want_outs):
        assert_same(a, b)


def test_parts_merged_into_their_block_reset_the_frontier(monkeypatch):
    """A forward that reads a part's weights merges the parts into their
    block (its deps from then on): a walk must not skip that block as one
    with nothing to bring."""
    from test_split import FusedLM, weights_budget
    from test_training import batches

    from pager.model import discover

    monkeypatch.setattr(discover, "SPLIT_MIN_BYTES", 1024)  # (the test model's projections are a few KiB)
    resets = []
    reset = Frontier.reset
    monkeypatch.setattr(Frontier, "reset", lambda self: (resets.append(1), reset(self)))
    model = FusedLM()
    pager.wrap(model, budget=weights_budget(model), device="cpu")
    p = pager.of(model)
    ids = batches(1)[0][0]
    with torch.no_grad():
        model(ids)  # (the reads are served: the parts merge)
        assert all(b.parts_merged for b in p.blocks if not b.part) and not resets
        model(ids)  # (their first use with the parts as deps)
    assert len(resets) == sum(1 for b in p.blocks if b.merged_deps) > 0
    pager.unwrap(model)
