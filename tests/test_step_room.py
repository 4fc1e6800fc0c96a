"""What an update on the device holds beside the pages is held out of the
room while it runs ([Note: the step's room] in training/step_room.py): the
state a first update creates, its copy into the page, and an unfused
optimizer's temporaries. On the CPU device the bytes the optimizer's own
step makes are counted op by op (each new storage until it is freed), and
with the pages on the device they stay within the budget; the values are
the unwrapped model's bit for bit."""

import copy
import sys
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import pager
from pager.training import step_room
from helpers import assert_models_equal

WIDTH, LAYERS = 256, 4


class NewBytes(TorchDispatchMode):
    """The bytes of storages that ops make while it is on, live now and at most."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if id(storage) in before or id(storage) in self._seen or not storage.nbytes():
                continue  # (an op in place, a view, a scalar)
            nbytes = storage.nbytes()
            self._seen.add(id(storage))
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, id(storage), nbytes)
        return out

    def _freed(self, key, nbytes):
        self._seen.discard(key)
        self.live -= nbytes


class Counted(torch.optim.AdamW):
    """AdamW (foreach) whose step records the pages on the device with the
    most its own ops held at once (a step without torch's decoration: pager
    calls it through the hooked one)."""

    held: list = []

    def step(self, closure=None):
        with NewBytes() as new:
            out = super().step(closure)
        Counted.held.append(pager.of(self.model).engine.resident_bytes + new.peak)
        return out


def watch_adoption(model, opt) -> list:
    """The pages on the device with the new state outside them, as each
    block's state page arrives (before the state is copied in)."""
    engine, seen = pager.of(model).engine, []
    fetch = engine.fetch

    def spy(block, kinds):
        fetch(block, kinds)
        if "state" in kinds and "state" in block.segments:
            page = block.segments["state"].flat.untyped_storage().data_ptr()
            fresh = {
                v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                for p in block.params
                for v in opt.state.get(p, {}).values()
                if isinstance(v, torch.Tensor) and v.dim() and v.untyped_storage().data_ptr() != page
            }
            if fresh:  # (its first: the state is the optimizer's still)
                seen.append(engine.resident_bytes + sum(fresh.values()))

    engine.fetch = spy
    return seen


def layers():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def steps(model, opt, n=3, batch=4):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(batch, WIDTH, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def block_bytes():
    return (WIDTH * WIDTH + WIDTH) * 4


@pytest.mark.parametrize("budget_blocks", [7, 10])
def test_the_first_update_and_its_temporaries_stay_within_the_budget(budget_blocks, monkeypatch):
    """A budget of `budget_blocks` layers' weights: every layer's weights,
    gradients and AdamW state (4 each) do not fit, so at the first step
    blocks leave for the state each update creates, its page and the foreach
    kernels' temporaries (one layer's weights again), as they would for a
    fetch; the pages and what the optimizer's ops hold stay within it."""
    ref = layers()
    model = copy.deepcopy(ref)
    budget = budget_blocks * block_bytes()
    pager.wrap(model, budget=budget, budget_covers="pager", defer_step=False, optimizer_step="device")
    opt = Counted(model.parameters(), lr=1e-2, foreach=True)
    opt.model = model
    Counted.held = []
    adopting = watch_adoption(model, opt)
    steps(model, opt)
    steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True))
    assert_models_equal(model, ref)
    assert len(Counted.held) >= LAYERS and max(Counted.held) <= budget, (Counted.held, budget)
    assert len(adopting) == LAYERS and max(adopting) <= budget, (adopting, budget)
    # Before the step's room was held, the first updates went over by their new state and temporaries.
    monkeypatch.setattr(step_room.StepRoom, "before", lambda self, blocks, shares: self.pager.step_bytes)
    again = copy.deepcopy(layers())
    pager.wrap(again, budget=budget, budget_covers="pager", defer_step=False, optimizer_step="device")
    opt = Counted(again.parameters(), lr=1e-2, foreach=True)
    opt.model = again
    Counted.held = []
    steps(again, opt, 1)
    assert max(Counted.held) > budget, (Counted.held, budget)


class Counters:
    """An allocator's counters (what CUDA's give) for updates that hold
    `copies` of their block's parameters beyond what was allocated before
    them, at their peak; or, `hidden`, under a higher peak from before."""

    ALLOCATED = 1 << 20

    def __init__(self, copies: float, hidden: bool = False):
        self.copies, self.reads = copies, 0
        self.peak = 1 << 40 if hidden else self.ALLOCATED

    def read(self):
        self.reads += 1
        if self.reads % 2 == 0:  # (after an update)
            self.peak = max(self.peak, self.ALLOCATED + int(self.copies * (WIDTH * WIDTH + WIDTH) * 4))
        return self.ALLOCATED, self.peak


@pytest.mark.parametrize("copies, hidden", [(3.0, False), (3.0, True), (0.5, False)])
def test_the_temporaries_are_learned_from_the_allocators_counters(copies, hidden):
    """Where the allocator's counters show an update's own peak, what it held
    beyond its pages and new state per parameter byte becomes the room held
    for the next (if more than the prior's one copy); a peak hidden under an
    earlier one, or a smaller one, changes nothing; each block is read for
    its first `MEASURED_STEPS` updates only."""
    model = layers()
    pager.wrap(model, budget=10 * block_bytes(), budget_covers="pager", defer_step=False, optimizer_step="device")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    steps(model, opt, 1)  # (the state made and adopted)
    room = pager.of(model).optimizers[0].step_room
    assert room.factor == step_room.TEMPORARIES_PRIOR
    room.counter, room._measured = Counters(copies, hidden), {}
    steps(model, opt, 3)
    learned = copies if copies > step_room.TEMPORARIES_PRIOR and not hidden else step_room.TEMPORARIES_PRIOR
    assert room.factor == pytest.approx(learned, rel=1e-6)
    assert room.counter.reads == 2 * LAYERS * step_room.MEASURED_STEPS
    assert pager.of(model).step_bytes == 0


def test_a_fused_update_holds_no_temporaries():
    model = layers()
    pager.wrap(model, budget=10 * block_bytes(), budget_covers="pager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True) if _fused_on_cpu() else None
    if opt is None:
        pytest.skip("torch's fused AdamW does not run on this CPU build")
    steps(model, opt, 1)
    assert pager.of(model).optimizers[0].step_room.factor == 0.0


def _fused_on_cpu() -> bool:
    try:
        p = nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except RuntimeError:
        return False


def test_a_budget_an_update_does_not_fit_is_refused_before_anything_runs_and_its_least_holds(caplog):
    """An update of a layer holds its foreach temporaries (a copy of its
    weights) beside the layer's pages: with activations this small, a
    budget that holds a layer with its gradients and state but not that is
    refused before the first forward, naming the least budget. At that
    budget the first updates hold: a new state page that does not fit
    beside the state the optimizer just made goes through host memory."""
    ref = layers()
    model = copy.deepcopy(ref)
    opt = Counted(model.parameters(), lr=1e-2, foreach=True)
    opt.model = model
    budget = int(4.5 * block_bytes())  # (a layer with its gradients and state: 4)
    pager.wrap(model, budget=budget, budget_covers="pager", optimizer=opt, defer_step=False, optimizer_step="device")
    with pytest.raises(pager.BudgetError, match="an update of a block on the device holds") as refused:
        steps(model, opt, 1)
    least = refused.value.least_budget_bytes
    assert 5 * block_bytes() <= least < 6 * block_bytes(), (least, block_bytes())
    assert all(p.grad is None for p in model.parameters()) and not opt.state  # (nothing ran)
    pager.unwrap(model)
    pager.wrap(model, budget=least, budget_covers="pager", optimizer=opt, defer_step=False, optimizer_step="device")
    Counted.held = []
    adopting = watch_adoption(model, opt)
    with caplog.at_level("DEBUG", logger="pager"):
        steps(model, opt)
    steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True))
    assert_models_equal(model, ref)
    assert max(Counted.held) <= least and max(adopting, default=0) <= least, (Counted.held, adopting, least)
    assert "new optimizer state went through host memory" in caplog.text


class CountedInUse(Counted):
    """Counted, with the activations pager holds at that moment: an update
    deferred to its block's next use runs inside a forward."""

    def step(self, closure=None):
        with NewBytes() as new:
            out = torch.optim.AdamW.step(self, closure)
        p = pager.of(self.model)
        Counted.held.append(p.engine.resident_bytes + p.activations.ledger.live + new.peak)
        return out


@pytest.mark.parametrize("batch, budget_blocks", [(4, 9), (128, 10)])
def test_an_update_deferred_to_the_next_forward_holds_its_temporaries_within_the_budget(
    batch, budget_blocks, monkeypatch
):
    """By default a block whose gradients left the device updates at its
    next use (`defer_step`), inside the next forward, beside its
    activations (few, or filling their reserve): room for its foreach
    temporaries is made on top of them, so the pages, the activations and
    the update's own ops stay within the budget; bit for bit. (Without
    that room, the same run goes over.)"""

    def run(model):
        opt = CountedInUse(model.parameters(), lr=1e-2, foreach=True)
        opt.model = model
        Counted.held = []
        steps(model, opt, 4, batch)
        return pager.of(model)

    ref = layers()
    model = copy.deepcopy(ref)
    budget = budget_blocks * block_bytes()  # (where the forward's prefetch fills the room)
    pager.wrap(model, budget=budget, budget_covers="pager", optimizer_step="device")
    p = run(model)
    steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True), 4, batch)
    assert_models_equal(model, ref)
    assert p.stats().deferred_steps > 0 and max(Counted.held) <= budget, (Counted.held, budget)
    temporaries = step_room.StepRoom.temporaries

    def none_in_a_use(self, blocks, shares):  # (no room made for the deferred update's; the step's still)
        return 0 if sys._getframe(1).f_code.co_name == "apply" else temporaries(self, blocks, shares)

    monkeypatch.setattr(step_room.StepRoom, "temporaries", none_in_a_use)
    again = layers()
    pager.wrap(again, budget=budget, budget_covers="pager", optimizer_step="device")
    run(again)
    assert max(Counted.held) > budget, (Counted.held, budget)


@pytest.mark.parametrize("budget_blocks", [17, 18])
def test_blocks_that_step_together_hold_their_temporaries_within_the_budget(budget_blocks):
    """Where every page is on the device, blocks with state step in one call
    of the optimizer, pinned: they go in runs whose temporaries together fit
    beside them (one call of all four held a copy of the whole model beside
    it: 1.11-1.18x these budgets); bit for bit."""
    ref = layers()
    model = copy.deepcopy(ref)
    budget = budget_blocks * block_bytes()  # (every layer with its gradients and state: 16)
    pager.wrap(model, budget=budget, budget_covers="pager", defer_step=False, optimizer_step="device")
    opt = Counted(model.parameters(), lr=1e-2, foreach=True)
    opt.model = model
    Counted.held = []
    steps(model, opt, 4)
    steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True), 4)
    assert_models_equal(model, ref)
    assert max(Counted.held) <= budget, (Counted.held, budget)


def test_each_first_update_holds_the_state_its_groups_options_make(monkeypatch):
    """The state a first update makes is figured from each block's own
    param groups' options (SGD with momentum: a buffer the size of the
    parameters), not from the groups as the step before narrowed them."""
    model = layers()
    pager.wrap(model, budget=10 * block_bytes(), budget_covers="pager", defer_step=False, optimizer_step="device")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    held = []
    hold = step_room.StepRoom._hold
    monkeypatch.setattr(step_room.StepRoom, "_hold", lambda self, n: (held.append(n), hold(self, n))[1])
    steps(model, opt, 1)
    # (each block's update: held before it, what it made, adopted, over)
    before, made = held[0 : 4 * LAYERS : 4], held[1 : 4 * LAYERS : 4]
    assert made == [block_bytes()] * LAYERS, (held, block_bytes())  # (a momentum buffer each)
    assert before == [2 * block_bytes()] * LAYERS, (held, block_bytes())  # (with one copy's temporaries)


class RootGain(nn.Module):
    """Layers, and a parameter of the model's own (the remainder) larger than any of them."""

    def __init__(self):
        super().__init__()
        self.layers = layers()
        self.gain = nn.Parameter(torch.ones(2 * WIDTH * WIDTH))

    def forward(self, x):
        return self.layers(x) * self.gain[:WIDTH] + self.gain[WIDTH:].sum() * 0


def test_the_least_budget_plan_names_trains():
    """`pager.plan`'s least budget counts the largest update's room, the
    remainder's included: at that budget the run trains unrefused."""
    torch.manual_seed(0)
    model = RootGain()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    x = torch.randn(4, WIDTH)
    least = pager.plan(model, "1GiB", device="cpu", inputs=(x,), optimizer=opt).train_min_budget_bytes
    pager.wrap(model, budget=least, device="cpu", optimizer=opt)
    steps(model, opt, 2)
