"""Training under a budget on the CPU device, bit for bit against the same
model trained unwrapped."""

import copy
import functools
import logging

import pytest
import torch
import torch.nn.functional as F

import pager
from helpers import assert_models_equal, assert_same, hooked_blocks, tensor_page_bytes
from models import SuperNet, TinyLM
from pager.training.grads import PagedOutGrad

OPTIMIZERS = {
    "sgd_momentum": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    "adam": functools.partial(torch.optim.Adam, lr=1e-2),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
    "adamw_foreach": functools.partial(torch.optim.AdamW, lr=1e-2, foreach=True),
    "adam_forloop": functools.partial(torch.optim.Adam, lr=1e-2, foreach=False),
    "rmsprop": functools.partial(torch.optim.RMSprop, lr=1e-3, momentum=0.5),
    "adagrad": functools.partial(torch.optim.Adagrad, lr=1e-2),
    "adamax": functools.partial(torch.optim.Adamax, lr=1e-2),
    "nadam": functools.partial(torch.optim.NAdam, lr=1e-2),
    "radam": functools.partial(torch.optim.RAdam, lr=1e-2),
}


def regime_budget(model, regime, state_factor=2):
    """'fits': every block with grads and state fits. 'streams': the budget
    holds the remainder and about 2.5 blocks with their grads and state, so a
    step's blocks do not fit and must pass through."""
    per_block = (2 + state_factor) * max(tensor_page_bytes(layer) for layer in model.layers)
    remainder = (2 + state_factor) * (tensor_page_bytes(model) - sum(tensor_page_bytes(layer) for layer in model.layers))
    if regime == "fits":
        return 1 << 30
    return remainder + int(2.5 * per_block)


def batches(n, vocab=64, generator=None):
    g = generator or torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (2, 8), generator=g), torch.randint(0, vocab, (2, 8), generator=g)) for _ in range(n)]


def lm_loss(model, ids, tgt):
    return F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten())


def train(model, opt, data, *, accumulate=True, clip=None, autocast=None, scaler=None, sched=None):
    for step, (ids, tgt) in enumerate(data):
        micro = [(ids, tgt), (ids.flip(0), tgt.flip(0))] if accumulate and step % 2 else [(ids, tgt)]
        for x, y in micro:
            if autocast is not None:
                with torch.autocast("cpu", dtype=autocast):
                    loss = lm_loss(model, x, y)
            else:
                loss = lm_loss(model, x, y)
            (scaler.scale(loss) if scaler else loss).backward()
        if clip is not None:
            if scaler:
                scaler.unscale_(opt)
            clip(model)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=bool(step % 3))
    return loss


def train_supernet(net, ref, opt, ref_opt, data, gen, n_candidates):
    """One sampled path per step, said in advance; the reference runs it too."""
    for ids, tgt in data:
        path = torch.randint(0, n_candidates, (len(net.layers),), generator=gen).tolist()
        net.set_path(path), ref.set_path(path)
        pager.of(net).expect(net.path_modules(path))
        for m, o in ((net, opt), (ref, ref_opt)):
            lm_loss(m, ids, tgt).backward()
            o.step()
            o.zero_grad()


def assert_trained_alike(model, opt, ref, ref_opt, ids):
    """Bit for bit: outputs, then (unwrapped) weights and optimizer state."""
    with torch.no_grad():
        assert_same(model(ids), ref(ids))
    pager.unwrap(model)
    assert_models_equal(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        for key, value in ref_opt.state[q].items():
            assert_same(opt.state[p][key], value)


def torch_clip(model):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("regime", ["fits", "streams"])
def test_training_matches_unwrapped_bit_for_bit(opt_name, regime):
    model = TinyLM()
    ref = copy.deepcopy(model)
    state_factor = {"sgd_momentum": 1, "rmsprop": 2, "adagrad": 1}.get(opt_name, 2)
    budget = regime_budget(model, regime, state_factor)
    make = OPTIMIZERS[opt_name]
    opt = make(model.parameters())  # built before wrap
    params_before = [p for g in opt.param_groups for p in g["params"]]
    pager.wrap(model, budget=budget, device="cpu")
    ref_opt = make(ref.parameters())
    data = batches(10)
    train(model, opt, data, clip=torch_clip)
    train(ref, ref_opt, data, clip=torch_clip)
    # The optimizer and its groups hold the very same Parameter objects.
    assert [p for g in opt.param_groups for p in g["params"]] == params_before
    assert all(a is b for a, b in zip(params_before, model.parameters()))
    s = pager.of(model).stats()
    assert s.peak_resident_bytes <= budget
    if regime == "streams":
        assert s.evictions > 0 and s.d2h_bytes > 0
    assert_trained_alike(model, opt, ref, ref_opt, data[0][0])


@pytest.mark.parametrize("regime", ["fits", "streams"])
def test_attach_before_first_step_and_lr_scheduler(regime):
    model = TinyLM()
    ref = copy.deepcopy(model)
    budget = regime_budget(model, regime)
    pager.wrap(model, budget=budget, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built after wrap
    pager.of(model).attach(opt)
    pager.of(model).attach(opt)  # idempotent
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)
    ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, 10)
    data = batches(6)
    train(model, opt, data, sched=sched)
    train(ref, ref_opt, data, sched=ref_sched)
    assert sched.get_last_lr() == ref_sched.get_last_lr()
    pager.unwrap(model)
    assert_models_equal(model, ref)


@pytest.mark.parametrize("regime", ["fits", "streams"])
def test_bf16_autocast(regime):
    model = TinyLM()
    ref = copy.deepcopy(model)
    budget = regime_budget(model, regime)
    pager.wrap(model, budget=budget, device="cpu", optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))
    opt = pager.of(model).optimizers[0].optimizer
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    data = batches(6)
    train(model, opt, data, autocast=torch.bfloat16)
    train(ref, ref_opt, data, autocast=torch.bfloat16)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_grad_scaler_when_the_step_fits():
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=1 << 30, device="cpu")
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    scaler, ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)
    data = batches(6)
    train(model, opt, data, scaler=scaler, clip=torch_clip)
    train(ref, ref_opt, data, scaler=ref_scaler, clip=torch_clip)
    assert scaler.get_scale() == ref_scaler.get_scale()
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_pagers_clip_grad_norm_is_torchs():
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    for m in (model, ref):
        lm_loss(m, *batches(1)[0]).backward()
    assert_same(pager.of(model).clip_grad_norm_(0.1), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1))
    pager.unwrap(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.grad, q.grad)


def test_the_first_torch_clip_moves_no_bytes():
    """Gradients leave with their norms from the first backward on: torch's
    clip at the first step fetches no block (it used to fetch every paged-out
    gradient, and warn of each), and gives torch's values bit for bit."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    for m in (model, ref):
        lm_loss(m, *batches(1)[0]).backward()
    pg = pager.of(model)
    assert any(isinstance(p.grad, PagedOutGrad) for p in model.parameters())
    before = pg.stats()
    assert_same(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1), torch_clip_norm(ref, 0.1))
    after = pg.stats()
    assert (after.h2d_bytes, after.on_demand, after.misses) == (before.h2d_bytes, before.on_demand, before.misses)
    pager.unwrap(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.grad, q.grad)


def torch_clip_norm(model, max_norm):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def test_zero_grad_keeping_tensors_while_paged_out():
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for ids, tgt in batches(4):
        for m, o in ((model, opt), (ref, ref_opt)):
            lm_loss(m, ids, tgt).backward()
            o.step()
            o.zero_grad(set_to_none=False)
    pager.unwrap(model)
    assert_models_equal(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.grad, q.grad)


@pytest.mark.parametrize("regime", ["fits", "streams"])
def test_frozen_parameters_are_not_stepped(regime):
    model = TinyLM()
    for p in list(model.embed.parameters()) + list(model.layers[1].parameters()):
        p.requires_grad_(False)
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, regime), device="cpu")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    data = batches(5)
    train(model, opt, data)
    train(ref, ref_opt, data)
    assert "grads" not in pager.of(model).blocks[1].segments
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_optimizer_state_dict_round_trip_and_resume():
    """Save model and optimizer mid-training while blocks are paged out, go
    on; then load the checkpoint and redo the same steps: same result."""
    model = TinyLM()
    budget = regime_budget(model, "streams")
    pager.wrap(model, budget=budget, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(8)
    train(model, opt, data[:4], accumulate=False)
    assert any(not b.segments["state"].resident for b in pager.of(model).blocks)
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, data[4:], accumulate=False)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    assert opt.state_dict()["state"].keys() == ckpt["opt"]["state"].keys()
    for k, v in opt.state_dict()["state"][0].items():
        assert_same(v, ckpt["opt"]["state"][0][k])
    train(model, opt, data[4:], accumulate=False)
    for k, v in model.state_dict().items():
        assert_same(v, first[k])
    assert pager.of(model).stats().peak_resident_bytes <= budget


def test_state_dict_needs_no_device_room_and_loads_elsewhere(tmp_path):
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    resident_before = pager.of(model).resident_bytes
    sd = model.state_dict()
    assert pager.of(model).resident_bytes == resident_before
    torch.save(sd, tmp_path / "ckpt.pt")
    fresh = TinyLM()
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt", map_location="cpu"))
    assert_models_equal(fresh, ref)


def _supernet_budget(net):
    """The remainder and 2.5 (layer, candidate) pairs, with grads and Adam state."""
    layer_attn = max(tensor_page_bytes(l.attn) + tensor_page_bytes(l.norm) for l in net.layers)
    cand = max(tensor_page_bytes(c) for l in net.layers for c in l.candidates)
    remainder = tensor_page_bytes(net.embed) + tensor_page_bytes(net.head)
    budget = 4 * remainder + int(2.5 * 4 * (layer_attn + cand))
    assert budget < 4 * tensor_page_bytes(net) / 2  # well under the supernet's weights + grads + Adam state
    return budget


def test_supernet_random_paths_train_like_unwrapped():
    """ProxylessNAS-style: one sampled path per step, said in advance with
    expect(). Inactive candidates get no grad, no state and no fetch."""
    net = SuperNet(n_layers=4)
    ref = copy.deepcopy(net)
    budget = _supernet_budget(net)
    pager.wrap(net, budget=budget, device="cpu")
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    # Candidate 3 is never sampled.
    train_supernet(net, ref, opt, ref_opt, batches(12), torch.Generator().manual_seed(3), n_candidates=3)
    pg = pager.of(net)
    assert pg.stats().peak_resident_bytes <= budget
    for i, layer in enumerate(net.layers):
        never = layer.candidates[3]
        assert all(p not in opt.state for p in never.parameters())
        block = next(b for b in pg.blocks if b.module is never)
        assert block.stats.fetches == 0 and "state" not in block.segments
    pager.unwrap(net)
    assert_models_equal(net, ref)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert (p in opt.state) == (q in ref_opt.state)


def test_step_with_closure_is_refused():
    model = TinyLM()
    pager.wrap(model, budget=1 << 30, device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: lm_loss(model, *batches(1)[0]))


def test_activation_checkpointing(caplog):
    from torch.utils.checkpoint import checkpoint

    class Ckpt(TinyLM):
        def forward(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False)
            return self.head(self.norm(x))

    model = Ckpt()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    data = batches(4)
    with caplog.at_level(logging.WARNING, logger="pager"):
        train(model, opt, data, accumulate=False)
    train(ref, ref_opt, data, accumulate=False)
    # What the recomputation in the backward saves is checkpointing's, not a
    # view kept by the user: nothing adopted (it would be written back at
    # every eviction), no warning.
    assert not any("was kept from its forward" in r.getMessage() for r in caplog.records)
    assert not any(ref() is not None for b in pager.of(model).blocks for ref, _cls in b.weights.aliases)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_unwrap_with_two_optimizers_detaches_both_and_frees_device_memory():
    model = TinyLM()
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    body = [p for n, p in model.named_parameters() if not n.startswith("layers.5")]
    last = list(model.layers[5].parameters())
    opt_a, opt_b = torch.optim.Adam(body, lr=1e-2), torch.optim.SGD(last, lr=0.1, momentum=0.9)
    for ids, tgt in batches(3):
        lm_loss(model, ids, tgt).backward()
        opt_a.step(), opt_b.step()
        opt_a.zero_grad(), opt_b.zero_grad()
    pg = pager.of(model)
    flats = [seg.flat for b in pg.all_blocks() for seg in b.segments.values()]
    assert any(f.untyped_storage().nbytes() > 0 for f in flats)
    pager.unwrap(model)
    assert not pg.optimizers  # both detached: their state is theirs again
    assert all(f.untyped_storage().nbytes() == 0 for f in flats)  # device memory given back
    for opt in (opt_a, opt_b):
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    # standalone tensors, not views of a page
                    assert v.untyped_storage().nbytes() == v.numel() * v.element_size()
    lm_loss(model, *batches(1)[0]).backward()
    opt_a.step(), opt_b.step()  # both optimizers keep training the unwrapped model


# -- deferred updates (see [Note: deferred updates] in training/optim.py) --------


def _opt_states_equal(opt, ref_opt, model, ref):
    for p, q in zip(model.parameters(), ref.parameters()):
        assert opt.state[p].keys() == ref_opt.state[q].keys()
        for key, value in ref_opt.state[q].items():
            assert_same(opt.state[p][key], value)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_deferred_updates_equal_immediate_ones_with_a_schedule_clip_and_eval(set_to_none):
    """Blocks paged out at step() are updated at their next use, with the
    learning rate (a tensor, changed in place by the schedule), the clipping
    and the gradients they had at step time: bit for bit the unwrapped run,
    also when checkpoints and an eval forward come in between."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu", optimizer_step="device")
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=torch.tensor(1e-2), weight_decay=0.01)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt, ref_opt)]
    pg = pager.of(model)
    for step, (ids, tgt) in enumerate(batches(6)):
        for m, o, clip, sched in ((model, opt, torch_clip, scheds[0]), (ref, ref_opt, torch_clip, scheds[1])):
            lm_loss(m, ids, tgt).backward()
            clip(m)
            o.step()
            sched.step()
            o.zero_grad(set_to_none=set_to_none)
        if step == 0:
            continue
        assert any(b.deferred_steps for b in pg.blocks)  # some updates are still pending here
        if step == 2:
            with torch.inference_mode():
                assert_same(model(ids), ref(ids))  # an eval forward applies what it uses
        if step == 3:
            assert_same(opt.state_dict()["state"][5]["exp_avg"], ref_opt.state_dict()["state"][5]["exp_avg"])
            assert_models_equal(model, ref)
    assert pg.stats().deferred_steps > 0
    pager.unwrap(model)
    assert_models_equal(model, ref)
    _opt_states_equal(opt, ref_opt, model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            assert_same(p.grad, q.grad)


def test_two_steps_on_the_same_gradients_and_a_clip_between():
    """step(), clip, step() with no forward between: the second update reads
    the gradients as the clip after the first left them."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu", optimizer_step="device")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    for ids, tgt in batches(3):
        for m, o, clip in ((model, opt, torch_clip), (ref, ref_opt, torch_clip)):
            lm_loss(m, ids, tgt).backward()
            o.step()
            clip(m)
            o.step()
            o.zero_grad()
    assert pager.of(model).stats().deferred_steps > 0
    pager.unwrap(model)
    assert_models_equal(model, ref)
    _opt_states_equal(opt, ref_opt, model, ref)


def test_an_update_waits_for_a_candidate_that_is_not_sampled_again():
    """NAS: a candidate's update stays pending until the candidate runs
    again or something reads it."""
    net = SuperNet(n_layers=4)
    ref = copy.deepcopy(net)
    pager.wrap(net, budget=_supernet_budget(net), device="cpu", optimizer_step="device")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (net, ref))
    gen = torch.Generator().manual_seed(3)
    pg = pager.of(net)
    train_supernet(net, ref, opt, ref_opt, batches(6), gen, len(net.layers[0].candidates))
    assert pg.stats().deferred_steps > 0
    pending = [b for b in pg.blocks if b.deferred_steps]
    assert pending
    moved = pg.stats().h2d_bytes
    ckpt = net.state_dict()  # applies them
    assert not any(b.deferred_steps for b in pg.blocks)
    # (it fetched their pages, unless a prefetch for their next use had brought them already)
    assert pg.stats().h2d_bytes > moved or all(b.weights.resident for b in pending)
    for k, v in ref.state_dict().items():
        assert_same(ckpt[k], v)
    pager.unwrap(net)
    _opt_states_equal(opt, ref_opt, net, ref)


def test_defer_step_false_steps_every_block_during_step():
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu", defer_step=False)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    data = batches(5)
    train(model, opt, data, clip=torch_clip)
    train(ref, ref_opt, data, clip=torch_clip)
    assert pager.of(model).stats().deferred_steps == 0
    assert not any(b.deferred_steps for b in pager.of(model).blocks)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_expect_predicts_the_backward_of_a_sampled_path():
    """With expect(path), the backward (this path in reverse, each layer
    before its candidate) is prefetched too: few fetches on demand, where
    last step's order (another path) would miss most of the backward."""
    net = SuperNet(n_layers=6)
    ref = copy.deepcopy(net)
    pager.wrap(net, budget=_supernet_budget(net), device="cpu")
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (net, ref))
    gen = torch.Generator().manual_seed(3)
    train_supernet(net, ref, opt, ref_opt, batches(4), gen, 4)
    pg = pager.of(net)
    pg.reset()
    train_supernet(net, ref, opt, ref_opt, batches(8), gen, 4)
    s = pg.stats()
    assert s.misses <= 8, s  # 39 when the backward followed last step's path
    pager.unwrap(net)
    assert_models_equal(net, ref)


@pytest.mark.parametrize("regime", ["fits", "streams"])
def test_a_second_backward_through_a_retained_graph(regime):
    """Each backward pass brings the blocks back (the pre-backward hook fires
    once per pass, not once per forward)."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, regime), device="cpu")
    ids = batches(1)[0][0]
    for m in (model, ref):
        out = m(ids).float().pow(2).mean()
        out.backward(retain_graph=True)
        out.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.grad, q.grad)


# -- training asleep: see [Note: asleep] in model/asleep.py ---------------------


def _fitting_pair():
    """A TinyLM wrapped under a budget that holds it all, its unwrapped twin,
    its pager, and an Adam for each."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=1 << 30, device="cpu")
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    return model, ref, pager.of(model), opt, ref_opt


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_resident_model_trains_without_block_hooks(set_to_none):
    """Once every block has its gradients' page, a model that fits trains with
    its block hooks off: bit for bit the unwrapped model's steps, two forwards
    into one backward too. Gradients zeroed in place stay in their pages;
    gradients set to None leave the device with their pages, and the next
    ones stay where autograd makes them ([Note: gradients outside their
    pages, asleep])."""
    model, ref, pg, opt, ref_opt = _fitting_pair()
    for i, (ids, tgt) in enumerate(batches(6)):
        if i == 1:  # (the first backward makes the gradients' pages)
            pg.reset()
        for m, o in ((model, opt), (ref, ref_opt)):
            loss = lm_loss(m, ids, tgt)
            if i % 2:
                loss = loss + lm_loss(m, ids.flip(0), tgt.flip(0))  # two forwards, one backward
            loss.backward()
            if m is model and i > 0:
                assert hooked_blocks(model) == 0
                pages = [s for b in pg.all_blocks() if (s := b.segments.get("grads")) is not None]
                if set_to_none:  # (the remainder's too: it is not in use between steps)
                    assert pages and not any(s.resident for s in pages)
                    assert all(p.grad is not None and p.grad is not t for s in pages for p, t in zip(s.params, s.tensors))
                else:
                    assert pages and all(p.grad is t for s in pages for p, t in zip(s.params, s.tensors))
            o.step()
            o.zero_grad(set_to_none=set_to_none)
    assert pg.stats().resident_forwards == 5 + 3  # (steps 1, 3 and 5 run two forwards)
    assert_trained_alike(model, opt, ref, ref_opt, batches(1)[0][0])


def test_gradients_set_to_none_leave_the_device_before_the_forward():
    """[Note: gradients set to None leave the device]: at a budget that holds
    everything, `zero_grad()` (set_to_none=True) frees the gradients in the
    unwrapped model; pager's grads pages leave too, before the next forward
    (whose activations get their room). Awake (a trace on), the backward
    makes them again, empty: nothing is copied either way, and training
    equals the unwrapped model bit for bit."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=1 << 30, device="cpu", trace_steps=8)  # (a trace keeps the pager awake)
    pg = pager.of(model)
    during_forward = []
    model.layers[-1].register_forward_hook(lambda *a: during_forward.append(pg.resident_bytes))
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    for i, (ids, tgt) in enumerate(batches(4)):
        for m, o in ((model, opt), (ref, ref_opt)):
            lm_loss(m, ids, tgt).backward()
            if m is model:
                pages = [s for b in pg.all_blocks() if (s := b.segments.get("grads")) is not None]
                assert pages and all(p.grad is t for s in pages for p, t in zip(s.params, s.tensors))
            o.step()
            o.zero_grad()
        if i > 0:  # weights and Adam's state only
            assert during_forward[-1] == pg.total_bytes - sum(s.nbytes for s in pages), i
    s = pg.stats()
    assert s.resident_forwards == 0 and s.d2h_bytes == 0 and s.h2d_bytes == tensor_page_bytes(model)
    assert_trained_alike(model, opt, ref, ref_opt, batches(1)[0][0])


def test_gradients_made_asleep_go_into_their_pages_before_a_block_leaves():
    """[Note: gradients outside their pages, asleep]: gradients made while the
    pager slept with their pages dropped are adopted into their pages when a
    lower budget wakes it between backward and step; the blocks then leave
    with them, and the step equals the unwrapped model's."""
    model, ref, pg, opt, ref_opt = _fitting_pair()
    data = batches(4)
    for i, (ids, tgt) in enumerate(data):
        for m, o in ((model, opt), (ref, ref_opt)):
            lm_loss(m, ids, tgt).backward()
            if m is model and i == 2:
                assert pg.asleep and not any(b.segments["grads"].resident for b in pg.blocks)
                pg.set_budget(regime_budget(model, "streams"))  # wakes it: gradients into pages, blocks leave
                assert not pg.asleep and pg.stats().evictions > 0
                for b in pg.blocks:  # none left on the device outside the budget
                    seg = b.segments["grads"]
                    assert all(p.grad is t or isinstance(p.grad, PagedOutGrad) for p, t in zip(seg.params, seg.tensors))
            o.step()
            o.zero_grad()
    assert_trained_alike(model, opt, ref, ref_opt, data[0][0])


def test_a_graph_built_asleep_keeps_every_block_until_autograd_lets_go():
    """Its backward has no hooks to bring a block back: while autograd holds
    what the forward saved (a retained graph too), no block may leave; then
    the budget may drop and training goes on paged, equal to unwrapped."""
    model, ref, pg, opt, ref_opt = _fitting_pair()
    data = batches(5)
    small = regime_budget(model, "streams")

    def step(m, o, ids, tgt):
        lm_loss(m, ids, tgt).backward()
        o.step()
        o.zero_grad()

    step(model, opt, *data[0])
    step(ref, ref_opt, *data[0])
    loss, ref_loss = lm_loss(model, *data[1]), lm_loss(ref, *data[1])
    assert hooked_blocks(model) == 0
    with pytest.raises(ValueError, match="between steps"):
        pg.set_budget(small)
    for retain in (True, False):  # a second pass through the retained graph
        loss.backward(retain_graph=retain)
        ref_loss.backward(retain_graph=retain)
        if retain:
            with pytest.raises(ValueError, match="between steps"):
                pg.set_budget(small)
    pg.set_budget(small)  # (`loss` lives on, but autograd let go of what it saved)
    assert pg.stats().evictions > 0
    opt.step(), ref_opt.step()
    opt.zero_grad(), ref_opt.zero_grad()
    for ids, tgt in data[2:]:
        step(model, opt, ids, tgt)
        step(ref, ref_opt, ids, tgt)
    assert hooked_blocks(model) == len(pg.blocks) and pg.stats().peak_resident_bytes <= (1 << 30)
    assert_trained_alike(model, opt, ref, ref_opt, data[0][0])


def test_a_supernet_trains_asleep_once_every_candidate_has_its_gradients_page():
    """A candidate's first gradient makes its page, which may need room: until
    every candidate has one, the forwards keep their hooks."""
    net = SuperNet(n_layers=2)
    ref = copy.deepcopy(net)
    pager.wrap(net, budget=1 << 30, device="cpu")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (net, ref))
    for step, path in enumerate(([0, 0], [1, 1], [2, 2], [3, 3], [0, 1], [2, 0])):
        if step == 3:  # every candidate but the last has its page
            assert hooked_blocks(net) > 0 and pager.of(net).stats().resident_forwards == 0
        net.set_path(path), ref.set_path(path)
        for m, o in ((net, opt), (ref, ref_opt)):
            lm_loss(m, *batches(1)[0]).backward()
            o.step()
            o.zero_grad()
    assert hooked_blocks(net) == 0 and pager.of(net).stats().resident_forwards == 2
    pager.unwrap(net)
    assert_models_equal(net, ref)


def test_a_step_asleep_runs_in_the_users_call_and_adopts_state_that_appears(monkeypatch):
    """[Note: a step asleep]: no block is acquired for the update; state that
    appears later (momentum turned on) still goes into its page."""
    from pager.training.optim import OptimizerLink

    streamed = []
    real = OptimizerLink._step_blocks
    monkeypatch.setattr(OptimizerLink, "_step_blocks", lambda self, *a: streamed.append(1) or real(self, *a))
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=1 << 30, device="cpu")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for i, (ids, tgt) in enumerate(batches(6)):
        if i == 1:
            first = len(streamed)  # (the first step runs streamed: it learns the blocks have no state)
        if i == 3:
            for o in (opt, ref_opt):
                o.param_groups[0]["momentum"] = 0.9
        for m, o in ((model, opt), (ref, ref_opt)):
            lm_loss(m, ids, tgt).backward()
            o.step()
            o.zero_grad()
    assert first > 0 and len(streamed) == first and hooked_blocks(model) == 0
    pages = [b.segments["state"] for b in pager.of(model).all_blocks() if "state" in b.segments]
    assert len(pages) == len(pager.of(model).all_blocks())
    assert all(opt.state[p]["momentum_buffer"] is view for s in pages for (p, _k), view in zip(s.keys, s.tensors))
    assert_trained_alike(model, opt, ref, ref_opt, batches(1)[0][0])


def test_a_forward_that_wakes_the_pager_leaves_a_graph_built_asleep_its_blocks():
    """Two forwards into one backward, the second with the hooks back on
    (a trace started between them): the first graph's blocks stay until
    its backward, which gives the unwrapped model's gradients."""
    model = TinyLM(n_layers=3)  # (the woken forward searches Python objects for views it cannot account for)
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=1 << 30, device="cpu")
    pg = pager.of(model)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    (a, ta), (b, tb), (c, tc) = batches(3)
    for m, o in ((model, opt), (ref, ref_opt)):
        lm_loss(m, a, ta).backward()
        o.step()
        o.zero_grad()
    first, ref_first = lm_loss(model, b, tb), lm_loss(ref, b, tb)
    assert hooked_blocks(model) == 0
    pg.start_trace(steps=1)
    second, ref_second = lm_loss(model, c, tc), lm_loss(ref, c, tc)
    assert hooked_blocks(model) == len(pg.blocks)
    with pytest.raises(ValueError, match="between steps"):  # (the held blocks' weights and state take more)
        pg.set_budget(tensor_page_bytes(model))
    (first + second).backward()
    (ref_first + ref_second).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.grad, q.grad)
    opt.step(), ref_opt.step()
    pg.set_budget(regime_budget(model, "streams"))
    assert pg.stats().evictions > 0
    assert_trained_alike(model, opt, ref, ref_opt, a)


@pytest.mark.parametrize("micro_steps", [2, 3])
def test_the_micro_steps_of_gradient_accumulation_are_predicted_in_their_cycle(micro_steps, caplog):
    """[Note: steps in a cycle of orders] in engine/schedule.py: a step begins
    at each forward, so accumulation makes a cycle of orders (micro-steps,
    then the last one with the optimizer's step); once it has been seen
    twice, each step is predicted by its own kind: no order changes, no
    advice to call expect(), and the values of the unwrapped model."""
    torch.manual_seed(0)
    model = TinyLM(n_layers=6)
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    p = pager.of(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    g = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="pager"):
        for step in range(10):
            if step == 4:  # (the cycle seen twice)
                p.reset()
            data = batches(micro_steps, generator=g)
            for m, o in ((model, opt), (ref, ref_opt)):
                for ids, tgt in data:
                    lm_loss(m, ids, tgt).backward()
                o.step()
                o.zero_grad()
    assert p.stats().order_changes == 0
    assert "order of blocks changed" not in caplog.text
    assert_models_equal(model, ref)


def test_the_scheduler_predicts_a_step_by_the_one_a_cycle_before():
    from pager.engine.schedule import Scheduler

    a, b, c = ([(object(), ("weights",))] * n for n in (1, 2, 3))  # three orders
    s = Scheduler()
    predicted = []
    for order in [a, a, b] * 4 + [c, c, c]:
        s.recording = list(order)
        s.start_step()
        predicted.append(len(s.plan))  # (the orders differ in length)
    # Two cycles seen (a a b a a b): the step a cycle before; a new order: the last one, as before.
    assert predicted[6:12] == [1, 2, 1, 1, 2, 1]
    assert predicted[-2:] == [3, 3]


@pytest.mark.parametrize("placement", ["host", "device"])
def test_parameters_unfrozen_after_training_started(placement):
    """A block that was wholly frozen gets its gradient page at its first
    backward, whenever that is: unfreezing it needs nothing. A parameter
    unfrozen in a block whose gradient page exists has no room there: the
    backward raises, naming it and the fix; the model, unwrapped and wrapped
    again, then trains on as the unwrapped one, bit for bit."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    kwargs = dict(budget=regime_budget(model, "streams"), device="cpu", optimizer_step=placement)
    pager.wrap(model, **kwargs)
    late = "layers.3.mlp.0.weight"
    runs = []
    for m in (model, ref):
        m.get_submodule("layers.0").requires_grad_(False)
        m.get_parameter(late).requires_grad_(False)
        runs.append((m, torch.optim.AdamW(m.parameters(), lr=1e-2)))
    data = batches(6)
    for m, opt in runs:
        train(m, opt, data[:2], accumulate=False)
        m.get_submodule("layers.0").requires_grad_(True)
        train(m, opt, data[2:3], accumulate=False)
    assert_models_equal(model, ref)

    for m, _opt in runs:
        m.get_parameter(late).requires_grad_(True)
    said = r"'layers\.3\.mlp\.0\.weight' \(block 'layers\.3'\) has a gradient.*pager\.unwrap"
    with pytest.raises(RuntimeError, match=said):
        lm_loss(model, *data[3]).backward()
    runs[0][1].zero_grad()
    pager.unwrap(model)
    pager.wrap(model, **kwargs)
    for m, opt in runs:
        train(m, opt, data[3:], accumulate=False)
    assert_models_equal(model, ref)
    states = [opt.state[m.get_parameter(late)] for m, opt in runs]
    assert_same(states[0]["exp_avg"], states[1]["exp_avg"])
