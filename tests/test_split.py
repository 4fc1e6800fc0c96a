"""Large default blocks stream as their parts, and a forward that reads a
part's weights without calling it is served, then fetches the parts together
(CPU device, bit for bit against the unwrapped model)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pager
from pager.model import discover as _discover
from helpers import assert_models_equal, assert_same, tensor_page_bytes
from models import TinyLM
from test_activations import activations_room
from test_training import batches, lm_loss, regime_budget


@pytest.fixture(autouse=True)
def _small_parts(monkeypatch):
    monkeypatch.setattr(_discover, "SPLIT_MIN_BYTES", 1024)  # the test models' projections are a few KiB


def weights_budget(model, layers=2.5):
    rest = tensor_page_bytes(model) - sum(tensor_page_bytes(l) for l in model.layers)
    return rest + int(layers * max(tensor_page_bytes(l) for l in model.layers))


class FusedMLP(nn.Module):
    """A layer whose forward reads its projections' weights without calling them."""

    def __init__(self, d=32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = F.linear(self.norm(x), self.up.weight, self.up.bias)
        return x + F.linear(F.gelu(h), self.down.weight, self.down.bias)


class FusedLM(TinyLM):
    def __init__(self, n_layers=6, d=32):
        super().__init__(d=d, n_layers=n_layers)
        self.layers = nn.ModuleList(FusedMLP(d) for _ in range(n_layers))


def test_large_blocks_stream_as_their_parts():
    model = TinyLM()
    ref = copy.deepcopy(model)
    budget = weights_budget(model)
    pager.wrap(model, budget=budget, device="cpu")
    names = pager.of(model).block_names()
    assert "layers.0" in names and "layers.0.attn.qkv" in names and "layers.0.mlp.0" in names
    assert "layers.0.norm1" not in names  # small parts stay with their block
    ids = batches(1)[0][0]
    with torch.no_grad():
        for _ in range(3):
            assert_same(model(ids), ref(ids))
    s = pager.of(model).stats()
    assert s.peak_resident_bytes <= budget and s.on_demand == 0
    # Parts make the streaming slots smaller: more of the model stays resident.
    assert len(pager.of(model).scheduler.kept) > 2


def test_parts_train_like_the_unwrapped_model():
    model = TinyLM(n_layers=12)  # its weights alone do not fit the budget below
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=4 * weights_budget(model, 1.5), device="cpu")  # weights, grads, Adam's two
    assert any(b.part for b in pager.of(model).blocks)
    opts = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for ids, tgt in batches(4):
        for m, o in zip((model, ref), opts):
            lm_loss(m, ids, tgt).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
            o.zero_grad()
    assert pager.of(model).stats().evictions > 0
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_a_forward_that_reads_a_parts_weights_fetches_the_parts_together(pager_log):
    model = FusedLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=weights_budget(model), device="cpu")
    p = pager.of(model)
    assert "layers.0.up" in p.block_names()
    ids = batches(1)[0][0]
    with torch.no_grad():
        assert_same(model(ids), ref(ids))  # the reads are served: right values
    assert "reads the tensors" in pager_log.text and all(b.parts_merged for b in p.blocks if not b.part)
    with torch.no_grad():
        model(ids)  # the parts now come with their layer
        before = p.stats().on_demand
        for _ in range(2):
            assert_same(model(ids), ref(ids))
    assert p.stats().on_demand == before
    assert p.stats().peak_resident_bytes <= p.budget_bytes


def test_fused_reads_train_like_the_unwrapped_model():
    model = FusedLM()
    ref = copy.deepcopy(model)
    # (4.5 layers' weights: the blocks with their gradients and momentum, and the activations beside them)
    budget = weights_budget(model, 4.5) + activations_room(model, batches(1)[0][0], min_bytes=1 << 20)
    pager.wrap(model, budget=budget, device="cpu")
    opts = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for ids, tgt in batches(4):
        for m, o in zip((model, ref), opts):
            lm_loss(m, ids, tgt).backward()
            o.step()
            o.zero_grad()
    pager.unwrap(model)
    assert_models_equal(model, ref)


@pytest.mark.parametrize("case", ["fits", "blocks given"])
def test_blocks_are_not_split_when_not_needed_or_named(case):
    model = TinyLM()
    if case == "fits":
        pager.wrap(model, budget=1 << 30, device="cpu")
    else:
        pager.wrap(model, budget=weights_budget(model), device="cpu", blocks=list(model.layers))
    assert not any(b.part for b in pager.of(model).blocks)


def rooms(model):
    """(the sizing of `model`'s default blocks, its remainder, its largest block) at any budget."""
    sizing = _discover.adapters_resident(_discover.size_up(model), 1 << 40)[0]
    return sizing, sizing.remainder, max(sizing.own)


def test_over_several_links_blocks_split_only_when_two_take_half_the_room():
    """[Note: splitting large blocks]: over one link, parts where two of the
    largest blocks take an eighth of the room; over several (split fetch),
    only where they take half of it."""
    model = TinyLM()
    sizing, remainder, largest = rooms(model)
    budget = remainder + 5 * largest  # (the model does not fit) two take two fifths of the room
    least = _discover.SPLIT_MIN_BYTES
    assert _discover.split_large(model, sizing, budget, least, links=1)[1]
    assert not _discover.split_large(model, sizing, budget, least, links=2)[1]
    assert _discover.split_large(model, sizing, remainder + 3 * largest, least, links=2)[1]  # (two take 2/3)
