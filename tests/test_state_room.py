"""Where a budget holds every block's weights and gradients but not their
activations beside the optimizer state, the state goes to host memory and
the updates run there ([Note: the state off the device] in
training/state_room.py). The trade is in a link's bytes, so it runs where a
link separates the device from host memory; here, on the CPU device, it is
switched on by hand (`linked`), and the values stay the unwrapped model's
bit for bit."""

import copy

import pytest
import torch
import torch.nn as nn

import pager
from pager.training import state_room
from helpers import assert_models_equal, hooked_blocks, tensor_page_bytes
from test_activations import Wide, offloading, wide_steps, activations_room

LAYERS = 6


@pytest.fixture
def linked(monkeypatch):
    monkeypatch.setattr(state_room, "link_between", lambda pager: True)


def one_block_saves(model) -> int:
    """What one block's training forward saves (each storage once)."""
    probe = offloading(copy.deepcopy(model), 1 << 30, "auto")
    wide_steps(probe.model, torch.optim.Adam(probe.model.parameters(), lr=1e-2), 1)
    return max(probe.activations.saved_bytes.values())


def trained(budget, steps=8, policy="auto"):
    """A model of `LAYERS` wide blocks, trained under `budget` with
    `activations=policy`, beside its unwrapped copy; the pager after `steps`
    steps and 3 more after a reset of its stats."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide() for _ in range(LAYERS)])
    ref = copy.deepcopy(model)
    p = offloading(model, budget, policy)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.01) for m in (model, ref))
    wide_steps(model, opt, steps)
    p.reset()
    wide_steps(model, opt, 3, seed=1)
    wide_steps(ref, ref_opt, steps)
    wide_steps(ref, ref_opt, 3, seed=1)
    return p, model, ref


def holds_blocks_not_activations(model) -> int:
    """A budget that holds every block with its gradients and Adam's state,
    and one block's activations beside them, not all."""
    return LAYERS * 4 * tensor_page_bytes(model[0]) + one_block_saves(model)


def test_the_state_leaves_the_device_and_the_updates_run_on_the_host(monkeypatch):
    """With a link, the blocks' state goes to host memory and their updates
    run there: the device holds less for the same activations, within the
    budget. Without one (the CPU device as it is), the state of blocks on
    the device stays there, and they update there."""
    torch.manual_seed(0)
    budget = holds_blocks_not_activations(nn.Sequential(*[Wide() for _ in range(LAYERS)]))
    # (offload, not "auto": which policy "auto" keeps depends on the machine's timing, and so does the peak)
    p_alone, model, ref = trained(budget, policy="offload")
    s_alone = p_alone.stats()
    assert not p_alone.host_steps.state_room.trading
    assert s_alone.host_steps < 3 * LAYERS  # (the blocks whose state stays on the device update there)
    pager.unwrap(model)
    assert_models_equal(model, ref)

    monkeypatch.setattr(state_room, "link_between", lambda pager: True)
    p, model, ref = trained(budget, policy="offload")
    s, room = p.stats(), p.host_steps.state_room
    assert room.trading and room.state_bytes == sum(b.segments["state"].nbytes for b in p.blocks)
    assert s.host_steps == 3 * LAYERS  # (every update on the host)
    assert s.activations_sent_bytes == s_alone.activations_sent_bytes > 0  # (the same activations out...)
    state = sum(b.segments["state"].nbytes for b in p.blocks)
    assert s.peak_device_bytes <= s_alone.peak_device_bytes - state // 2, (s.peak_device_bytes, s_alone)  # (...less held)
    assert s.peak_device_bytes <= budget, (s.peak_device_bytes, budget)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_a_model_that_fits_keeps_its_state_and_sleeps(linked):
    """Where every activation stays beside every block's state, nothing
    trades: the state stays, and the model trains asleep."""
    p, model, ref = trained(1 << 30)
    s, room = p.stats(), p.host_steps.state_room
    assert not room.trading and room.state_bytes == 0 and s.host_steps == 0
    assert s.activations_policy == "keep" and hooked_blocks(model) == 0
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_a_budget_too_small_for_the_blocks_trades_nothing(linked):
    """Where the blocks' weights and gradients alone exceed the budget less
    the activations it holds, blocks stream anyway: the state of those the
    scheduler keeps stays with them."""
    torch.manual_seed(0)
    # (2.5 blocks with their gradients and Adam's state, and room for the activations: the budget bounds them too)
    room = activations_room(nn.Sequential(*[Wide() for _ in range(LAYERS)]), torch.zeros(256, 32))
    budget = int(2.5 * 4 * tensor_page_bytes(Wide())) + room
    p, model, ref = trained(budget)
    assert not p.host_steps.state_room.trading
    assert p.stats().host_steps > 0  # (blocks stream: their state is in host memory anyway)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_blocks_leave_after_the_last_backward_of_a_step(linked):
    """Under accumulation the blocks updated on the host stay on the device
    through the step's earlier backward passes, and leave as their backward
    ends in its last (their gradients go down during the backward); clipping
    and accumulation keep the unwrapped model's values."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide() for _ in range(LAYERS)])
    ref = copy.deepcopy(model)
    budget = holds_blocks_not_activations(model)
    p = offloading(model, budget, "auto")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    g = torch.Generator().manual_seed(0)
    resident_after = []
    for step in range(8):
        xs = [torch.randn(256, 32, generator=g) for _ in range(2)]
        for m, o in ((model, opt), (ref, ref_opt)):
            for i, x in enumerate(xs):
                m(x).pow(2).mean().backward()
                if m is model and step >= 6:
                    resident_after.append((i, {b.name for b in p.engine.resident}))
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
            o.zero_grad()
    room = p.host_steps.state_room
    assert room.trading and room.backwards_per_step == 2
    traded = {b.name for b in room.on_host}
    for i, resident in resident_after:
        if i == 0:
            assert traded <= resident, (traded, resident)  # still there for the second micro-batch
        else:
            assert not traded & resident - {p.blocks[0].name}, (traded, resident)  # (the first: no backward hook)
    assert p.stats().host_steps > 0
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_blocks_with_frozen_weights_keep_them(linked):
    """A block with frozen parameters (LoRA's base weights) does not leave
    for its update: its frozen page would go and come back unchanged. At the
    budget where a block without one trades, it stays on the device, and the
    values stay the unwrapped model's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide() for _ in range(LAYERS)])
    for layer in model:
        layer.up.requires_grad_(False)
    ref = copy.deepcopy(model)
    budget = holds_blocks_not_activations(model)
    p = offloading(model, budget, "offload")
    opt, ref_opt = (torch.optim.Adam([q for q in m.parameters() if q.requires_grad], lr=1e-2) for m in (model, ref))
    wide_steps(model, opt, 4)
    p.reset()
    wide_steps(model, opt, 3, seed=1)
    wide_steps(ref, ref_opt, 4)
    wide_steps(ref, ref_opt, 3, seed=1)
    room, s = p.host_steps.state_room, p.stats()
    assert all("frozen" in b.segments for b in p.blocks)
    assert not room.trading and not room.awaiting
    assert s.evictions == 0, s  # (the blocks stay, frozen pages and all)
    pager.unwrap(model)
    assert_models_equal(model, ref)
