"""activations="offload": what blocks' training forwards save goes to host
memory and comes back for the backward ([Note: activations off the device]
in pager/_saved.py). CPU device, bit for bit against the model trained
unwrapped; every test checks that activations did leave, so none can pass
with the offload doing nothing."""

import copy
import gc

import pytest
import torch
import torch.nn as nn

import pager
from helpers import assert_models_equal, assert_same
from models import TinyLM
from test_training import batches, regime_budget, torch_clip, train


def offloading(model, budget, **kwargs):
    pager.wrap(model, budget=budget, device="cpu", activations="offload", **kwargs)
    pager.of(model)._activations.min_bytes = 0  # these models' activations are a few KiB
    return pager.of(model)


@pytest.mark.parametrize("regime", ["fits", "streams"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_training_with_activations_offloaded_matches_unwrapped(regime, autocast):
    model = TinyLM()
    ref = copy.deepcopy(model)
    p = offloading(model, regime_budget(model, regime))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(6)
    train(model, opt, data, clip=torch_clip, autocast=autocast)  # with accumulation
    train(ref, ref_opt, data, clip=torch_clip, autocast=autocast)
    s = p.stats()
    assert s.activations_sent_bytes > 0
    assert s.activations_brought_bytes == s.activations_sent_bytes  # each came back once
    assert s.activations_ahead_bytes > 0  # brought at the block's pre-backward, before autograd asked
    pager.unwrap(model)
    assert_models_equal(model, ref)


class SavesViews(nn.Module):
    """Saves views of its input (a contiguous slice, a transposed one) and its
    own output (tanh), and reads a dropout mask from the global RNG."""

    def __init__(self, d=32):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        head, tail = x[:2], x[2:]  # contiguous views of the input
        y = torch.cat([head * 2.0, tail.t().t() * 3.0])  # a non-contiguous one too
        return self.drop(torch.tanh(self.lin(y))) + x.sin()


def test_views_outputs_and_dropout_masks_under_offload():
    torch.manual_seed(0)
    model = nn.Sequential(*[SavesViews() for _ in range(5)])
    ref = copy.deepcopy(model)
    one = sum(t.numel() * t.element_size() for t in model[0].state_dict().values())
    p = offloading(model, 4 * one + 4096)
    x = torch.randn(6, 32, requires_grad=True)
    rx = x.detach().clone().requires_grad_(True)
    torch.manual_seed(1)
    model(x).pow(2).sum().backward()
    torch.manual_seed(1)
    ref(rx).pow(2).sum().backward()
    assert p.stats().activations_sent_bytes > 0
    assert_same(x.grad, rx.grad)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert_same(a.grad, b.grad)


def test_a_graph_kept_for_a_second_backward_and_one_dropped_unused():
    model = TinyLM()
    ref = copy.deepcopy(model)
    p = offloading(model, regime_budget(model, "streams"))
    ids = batches(1)[0][0]
    for m in (model, ref):
        out = m(ids).float().pow(2).mean()
        out.backward(retain_graph=True)  # a second backward brings the activations again
        out.backward()
    s = p.stats()
    assert s.activations_brought_bytes == 2 * s.activations_sent_bytes
    for a, b in zip(model.parameters(), ref.parameters()):
        assert_same(a.grad, b.grad)
    sent = s.activations_sent_bytes
    out = model(ids)  # a graph no backward comes for: its host copies go with it
    assert p.stats().activations_sent_bytes > sent
    copies = [r for _block, refs, _bytes in p._activations._groups for r in refs]
    assert copies and all(r() is not None for r in copies)
    del out
    gc.collect()
    assert all(r() is None for r in copies)
    model(ids).sum().backward()
    assert not p._activations._groups  # forgotten, and this step's were each reached by its backward


def test_no_grad_forwards_and_the_keep_policy_send_nothing():
    model = TinyLM()
    p = offloading(model, regime_budget(model, "streams"))
    with torch.no_grad():
        model(batches(1)[0][0])
    assert p.stats().activations_sent_bytes == 0
    kept = TinyLM()
    pager.wrap(kept, budget=regime_budget(kept, "streams"), device="cpu")
    kept(batches(1)[0][0]).sum().backward()
    assert pager.of(kept)._activations is None and pager.of(kept).stats().activations_sent_bytes == 0


def test_an_unknown_policy_is_refused_before_anything_changes():
    model = TinyLM()
    before = [t.clone() for t in model.state_dict().values()]
    with pytest.raises(ValueError, match="activations='gpu'.*keep.*offload"):
        pager.wrap(model, budget="1GiB", device="cpu", activations="gpu")
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
    with pytest.raises(ValueError, match="not wrapped"):
        pager.of(model)


def test_user_saved_tensor_hooks_win():
    """Inside the user's own saved-tensor hooks (here save_on_cpu's), pager's
    stand aside: the user's policy applies, and nothing is offloaded twice."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    p = offloading(model, regime_budget(model, "streams"))
    ids = batches(1)[0][0]
    for m in (model, ref):
        with torch.autograd.graph.save_on_cpu():
            m(ids).pow(2).sum().backward()
    assert p.stats().activations_sent_bytes == 0
    for a, b in zip(model.parameters(), ref.parameters()):
        assert_same(a.grad, b.grad)


def test_the_last_blocks_activations_stay_on_the_device():
    """The backward needs the last block's activations first: from the second
    forward on (the order is known), they are not sent out and straight back."""
    model = TinyLM()
    p = offloading(model, regime_budget(model, "streams"))
    ids = batches(1)[0][0]
    block_of = {b.module: b for b in p.blocks}
    model(ids).sum().backward()
    out = model(ids)
    sent_for = [g[0] for g in p._activations._groups]
    assert block_of[model.layers[4]] in sent_for and block_of[model.layers[5]] not in sent_for
    out.sum().backward()
