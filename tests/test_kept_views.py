"""Views of a block's tensors taken while it is in use (inside its forward, by
a hook, while the pager sleeps) and kept past its eviction read the right
values, never freed memory ([Note: views kept from a use] in base/views.py).
CPU device, bit for bit against an unwrapped twin."""

import copy

import pytest
import torch
import torch.nn as nn

from torch._subclasses.fake_tensor import FakeTensor

import pager
from helpers import assert_same
from test_transparency import page_out_everything
from pager.base import views
class Keeper(nn.Module):
    """Keeps views of its weight: as an attribute, in a list outside the model,
    and hands a slice of its table to the next layer."""

    def __init__(self, d=32, kept=None):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("table", torch.randn(16, d))
        self.kept = kept

    def forward(self, x):
        self.cache = self.lin.weight.t()
        if self.kept is not None:
            self.kept.append(self.lin.weight[:3])
        return torch.tanh(self.lin(x)), self.table[: x.shape[0]]


class Chain(nn.Module):
    def __init__(self, n=6, kept=None):
        super().__init__()
        self.layers = nn.ModuleList(Keeper(kept=kept) for _ in range(n))

    def forward(self, x):
        slices = []
        for layer in self.layers:
            x, s = layer(x)
            slices.append(s)
        # The slices of every layer's table are read after all layers ran
        # (most have left by then).
        return x + sum(s.sum(0) for s in slices), slices


def pair(kept=None, ref_kept=None, activations="auto"):
    torch.manual_seed(0)
    model = Chain(kept=kept)
    ref = copy.deepcopy(model)
    for layer in ref.layers:
        layer.kept = ref_kept
    one = sum(t.numel() * t.element_size() for t in model.layers[0].state_dict().values())
    # (a budget of blocks, pager's alone: what the process holds beside them is test_outside.py's)
    pager.wrap(model, budget=2 * one + 4096, device="cpu", activations=activations, budget_covers="pager")
    return model, ref


def page_out(model):
    page_out_everything(model, check=False)


@pytest.mark.parametrize("grad", [False, True])
def test_views_kept_from_a_forward_read_the_right_values(grad):
    kept, ref_kept = [], []
    model, ref = pair(kept, ref_kept)
    x = torch.randn(4, 32)
    with torch.set_grad_enabled(grad):
        out, slices = model(x)
        ref_out, ref_slices = ref(x)
    assert_same(out, ref_out)  # the output slices were read after their blocks left
    if grad:
        # The first training forward ran once before on fake tensors, to measure what it saves
        # ([Note: activations measured without running]): what that run appended is fake.
        fakes = [k for k in kept if isinstance(k, FakeTensor)]
        assert len(fakes) == len(model.layers) and kept[: len(fakes)] == fakes
        del kept[: len(fakes)]
    page_out(model)
    assert not pager.of(model).blocks[0].weights.resident
    for layer, ref_layer in zip(model.layers, ref.layers):
        assert_same(layer.cache, ref_layer.cache)  # an attribute
    for k, r in zip(kept, ref_kept):
        assert_same(k, r)  # a list outside the model: found among all Python objects
    for s, r in zip(slices, ref_slices):
        assert_same(s, r)  # outputs
    if grad:
        out.sum().backward()
        ref_out.sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_same(p.grad, q.grad)


def test_a_write_through_a_kept_view_reaches_the_weight():
    model, ref = pair()
    x = torch.randn(4, 32)
    with torch.no_grad():
        model(x)
        ref(x)
        page_out(model)
        model.layers[2].cache.mul_(0.5)  # a view of lin.weight, its block paged out
        ref.layers[2].cache.mul_(0.5)
        page_out(model)
        assert_same(model(x)[0], ref(x)[0])
    assert_same(model.layers[2].lin.weight, ref.layers[2].lin.weight)


def test_training_steps_search_python_objects_only_when_something_new_is_kept(monkeypatch):
    """Autograd's saved views of the weights are learned at the first step:
    later steps pay a reference count per block, not a search of every object.
    (With activations under the budget, pager's saved-tensor hooks count them
    as they are saved: no search at all.)"""
    model, ref = pair(activations="keep")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    searches = []
    real = views._python_tensors
    monkeypatch.setattr(views, "_python_tensors", lambda: searches.append(1) or real())
    x = torch.randn(4, 32)
    for step in range(4):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x)[0].pow(2).sum().backward()
            o.step()
            o.zero_grad()
        if step == 0:
            first = len(searches)
    assert first > 0 and len(searches) == first
    page_out(model)
    for layer, ref_layer in zip(model.layers, ref.layers):
        assert_same(layer.lin.weight, ref_layer.lin.weight)
        assert_same(layer.cache, ref_layer.cache)


def test_a_view_taken_while_the_pager_sleeps_survives_a_later_eviction():
    model, ref = pair()
    p = pager.of(model)
    p.set_budget("1GiB")
    x = torch.randn(4, 32)
    with torch.no_grad():
        for _ in range(3):
            model(x)
        assert p.asleep
        view = model.layers[1].lin.weight.detach()[0]  # taken with the tensors exposed, no fetch
        ref_view = ref.layers[1].lin.weight.detach()[0]
        one = sum(t.numel() * t.element_size() for t in model.layers[0].state_dict().values())
        p.set_budget(2 * one + 4096)
        model(x)  # wakes: the view is found and guarded; the blocks then stream
    page_out(model)
    # Alone, the view is found and guarded and its block leaves; with other
    # threads about (test_shared_mode) it cannot be looked for, so the block stays.
    assert p.blocks[1].weights.resident == p.shared_mode
    assert_same(view, ref_view)


class ExpOf(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(x).exp()  # exp saves its output


def test_an_in_place_change_of_a_saved_tensor_is_still_an_error():
    """Autograd's check that a saved tensor was not changed in place holds
    under pager (its saved-tensor hooks check it too: [Note: autograd's saved
    views, counted])."""
    model = nn.Sequential(ExpOf(), ExpOf(), ExpOf())
    one = sum(t.numel() * t.element_size() for t in model[0].state_dict().values())
    pager.wrap(model, budget=2 * one + 4096, device="cpu", budget_covers="pager")  # a block's weights and gradients
    out = model(torch.randn(4, 32) * 0.1)
    with torch.no_grad():
        out.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
