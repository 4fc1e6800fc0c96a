"""float32 master weights of a bf16 model (`wrap(master_weights=True)`,
[Note: master weights] in training/masters.py), on the CPU device: bit for
bit the loop that keeps masters by hand, wherever the updates run."""

import copy
import functools

import pytest
import torch

import pager
from helpers import assert_models_equal, assert_same
from models import TinyLM
from pager.training import master_pass
from pager.training.masters import MASTER
from test_training import batches, lm_loss, regime_budget, torch_clip, train

OPTIMIZERS = {
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
    "adam_fused": functools.partial(torch.optim.Adam, lr=1e-2, weight_decay=0.01, fused=True),
    "sgd_momentum": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=0.01),
}


class HandMasters(torch.optim.Optimizer):
    """The reference: a float32 copy of every bf16 parameter, stepped by
    `make`'s optimizer with the gradient in float32; the parameter gets the
    copy's rounding. Takes `step()`, `zero_grad()`, a scheduler, as the
    optimizer it stands for."""

    def __init__(self, model, make):
        self.params = list(model.parameters())
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in self.params]
        self.inner = make(self.masters)
        self.param_groups, self.defaults, self.state = self.inner.param_groups, self.inner.defaults, self.inner.state
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            if p.grad is not None:
                p.grad = None if set_to_none else p.grad.zero_()


def bf16_lm():
    return TinyLM().to(torch.bfloat16)


def assert_states_equal(opt, model, ref_opt):
    """The wrapped optimizer's state of each parameter: the reference's
    float32 state of its master, and the master itself."""
    for p, m in zip(model.parameters(), ref_opt.masters):
        mine, theirs = opt.state[p], ref_opt.state[m]
        assert set(mine) == set(theirs) | {MASTER}
        assert_same(mine[MASTER], m.detach())
        for key, value in theirs.items():
            assert mine[key].dtype == value.dtype
            assert_same(mine[key], value)


def scheduled(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


@pytest.mark.parametrize("defer_step", [True, False])
@pytest.mark.parametrize("placement", ["host", "device", "auto"])
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_master_weights_equal_masters_kept_by_hand(opt_name, placement, defer_step):
    """Accumulation, torch's clip_grad_norm_, an LR schedule, zero_grad both
    ways, with the blocks streaming: the weights, the masters and the
    float32 state equal the hand-kept loop's bit for bit."""
    model = bf16_lm()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams", state_factor=6), device="cpu",
               optimizer_step=placement, defer_step=defer_step, master_weights=True)
    opt, ref_opt = OPTIMIZERS[opt_name](model.parameters()), HandMasters(ref, OPTIMIZERS[opt_name])
    data = batches(7)
    train(model, opt, data, clip=torch_clip, sched=scheduled(opt))
    train(ref, ref_opt, data, clip=torch_clip, sched=scheduled(ref_opt))
    s = pager.of(model).stats()
    assert (s.host_steps > 0) == (placement != "device")
    assert s.evictions > 0 and (s.deferred_steps > 0) == (placement == "device" and defer_step)
    assert_models_equal(model, ref)
    assert_states_equal(opt, model, ref_opt)
    # The masters are what the model would not keep in bf16: they differ from
    # the weights (updates below a bf16 ulp accumulate there).
    assert any(not torch.equal(opt.state[p][MASTER].to(torch.bfloat16).float(), opt.state[p][MASTER])
               for p in model.parameters())


def test_without_the_option_bf16_state_and_a_lower_precision_run():
    """The control: without masters the same run keeps bf16 state and ends
    elsewhere (so the test above compares something the option changes)."""
    model, plain = bf16_lm(), bf16_lm()
    plain.load_state_dict(model.state_dict())
    budget = regime_budget(model, "streams", state_factor=6)
    pager.wrap(model, budget=budget, device="cpu", master_weights=True)
    pager.wrap(plain, budget=budget, device="cpu")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, plain)]
    data = batches(4)
    for m, o in zip((model, plain), opts):
        train(m, o, data)
    p = next(iter(plain.parameters()))
    assert opts[1].state[p]["exp_avg"].dtype == torch.bfloat16 and MASTER not in opts[1].state[p]
    assert opts[0].state[next(iter(model.parameters()))]["exp_avg"].dtype == torch.float32
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))


def test_float32_parameters_have_no_master():
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu", master_weights=True)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(4)
    train(model, opt, data)
    train(ref, ref_opt, data)
    assert_models_equal(model, ref)
    assert all(MASTER not in opt.state[p] for p in model.parameters())


@pytest.mark.parametrize("placement", ["host", "device"])
def test_a_checkpoint_with_masters_resumes_bit_for_bit(placement):
    """opt.state_dict() holds the float32 masters and state (load_state_dict
    would cast them to bf16: they are put back), and a run resumed from it,
    in another wrapped model, continues as the one that went on."""
    model = bf16_lm()
    ref = copy.deepcopy(model)
    kwargs = dict(budget=regime_budget(model, "streams", state_factor=6), device="cpu", optimizer_step=placement,
                  master_weights=True)
    pager.wrap(model, **kwargs)
    opt, ref_opt = OPTIMIZERS["adamw"](model.parameters()), HandMasters(ref, OPTIMIZERS["adamw"])
    data = batches(6)
    train(model, opt, data[:3])
    train(ref, ref_opt, data[:3])
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    saved = next(iter(ckpt["opt"]["state"].values()))
    assert saved[MASTER].dtype == torch.float32 and saved["exp_avg"].dtype == torch.float32

    resumed = bf16_lm()
    pager.wrap(resumed, **kwargs)
    resumed_opt = OPTIMIZERS["adamw"](resumed.parameters())
    pager.of(resumed).attach(resumed_opt)  # (before the load: its hooks keep the float32 values)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["opt"])
    train(resumed, resumed_opt, data[3:])
    train(ref, ref_opt, data[3:])
    assert_models_equal(resumed, ref)
    assert_states_equal(resumed_opt, resumed, ref_opt)


def test_state_loaded_before_attach_is_refused_at_attach():
    """torch's load_state_dict casts state to the parameter's dtype; loaded
    before pager attached the optimizer, the masters are bf16 already: the
    first step says so, and how to load instead."""
    model = bf16_lm()
    budget = regime_budget(model, "streams", state_factor=6)
    pager.wrap(model, budget=budget, device="cpu", master_weights=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, batches(2))
    ckpt = copy.deepcopy(opt.state_dict())
    other = bf16_lm()
    pager.wrap(other, budget=budget, device="cpu", master_weights=True)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other_opt.load_state_dict(ckpt)  # (not attached yet: torch casts)
    with pytest.raises(ValueError, match="loaded before pager attached it.*attach\\(opt\\)"):
        train(other, other_opt, batches(1))
    plain = torch.optim.AdamW(other.parameters(), lr=1e-2)
    plain.load_state_dict({**ckpt, "state": {k: {n: v for n, v in e.items() if n != MASTER}
                                             for k, e in ckpt["state"].items()}})
    with pytest.raises(ValueError, match="without a float32 master"):
        pager.of(other).attach(plain)


def test_state_saved_without_masters_is_refused_before_anything_loads():
    plain = bf16_lm()
    model = copy.deepcopy(plain)
    budget = regime_budget(plain, "streams", state_factor=6)
    pager.wrap(plain, budget=budget, device="cpu")
    pager.wrap(model, budget=budget, device="cpu", master_weights=True)
    plain_opt, opt = torch.optim.AdamW(plain.parameters(), lr=1e-2), torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(2)
    train(plain, plain_opt, data)
    train(model, opt, data)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="no float32 master for 'embed.weight'.*without master_weights"):
        opt.load_state_dict(plain_opt.state_dict())
    after = opt.state_dict()
    for key, entries in before["state"].items():
        for name, value in entries.items():
            assert_same(after["state"][key][name], value)


def test_unwrap_leaves_the_state_torch_keeps_for_the_parameter():
    """No master after unwrap, and state in the parameter's dtype: the
    optimizer steps the unwrapped bf16 model as torch would."""
    model = bf16_lm()
    pager.wrap(model, budget=regime_budget(model, "streams", state_factor=6), device="cpu", master_weights=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, batches(3))
    pager.unwrap(model)
    for p in model.parameters():
        assert MASTER not in opt.state[p] and opt.state[p]["exp_avg"].dtype == torch.bfloat16
    train(model, opt, batches(2))  # (raises if the state's dtype were not the parameter's)


@pytest.mark.parametrize("placement", ["host", "device"])
def test_state_made_by_the_constructor_is_made_again_for_the_masters(placement):
    """Adagrad makes its state in its constructor, before pager attaches it:
    a sum of 0.1 (not a bf16 value) made for the bf16 parameter is made
    again for its float32 master, and the run equals the hand-kept loop's
    bit for bit. State an update changed is still refused."""
    make = functools.partial(torch.optim.Adagrad, lr=1e-2, lr_decay=0.01, initial_accumulator_value=0.1)
    model = bf16_lm()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams", state_factor=6), device="cpu",
               optimizer_step=placement, master_weights=True)
    opt, ref_opt = make(model.parameters()), HandMasters(ref, make)
    data = batches(5)
    train(model, opt, data, clip=torch_clip)
    train(ref, ref_opt, data, clip=torch_clip)
    assert (pager.of(model).stats().host_steps > 0) == (placement == "host")
    assert_models_equal(model, ref)
    assert_states_equal(opt, model, ref_opt)

    stepped = bf16_lm()
    opt = make(stepped.parameters())
    last = list(stepped.parameters())[-1]
    last.grad = torch.ones_like(last)
    opt.step()  # (one parameter's state changed; the others' are still the constructor's)
    before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in stepped.parameters()}
    pager.wrap(stepped, budget=regime_budget(stepped, "streams", state_factor=6), device="cpu", master_weights=True)
    with pytest.raises(ValueError, match=r"state for '.*' \(torch.bfloat16\) without a float32 master"):
        pager.of(stepped).attach(opt)
    for p in stepped.parameters():  # (nothing remade)
        assert all(torch.equal(v, before[p][k]) and v.dtype == before[p][k].dtype for k, v in opt.state[p].items())


def test_master_weights_refuses_what_it_cannot_step():
    class NotTorch:  # an optimizer-like object without torch.optim's step
        def __init__(self, params):
            self.param_groups = [{"params": list(params)}]

    model = bf16_lm()
    pager.wrap(model, budget=regime_budget(model, "streams", state_factor=6), device="cpu", master_weights=True)
    with pytest.raises(ValueError, match="master_weights=True.*undecorated step"):
        pager.of(model).attach(NotTorch(model.parameters()))
    with pytest.raises(ValueError, match="master_weights='yes' must be True or False"):
        pager.wrap(bf16_lm(), budget="1GiB", device="cpu", master_weights="yes")
    table = torch.nn.Sequential(torch.nn.Embedding(1000, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="embedding table '0'.*paged by rows"):
        pager.wrap(table, budget=10**6, device="cpu", rows=["0"], master_weights=True)
    assert not any(hasattr(m, "_pager") for m in table.modules())


@pytest.mark.cuda
@pytest.mark.parametrize("placement", ["host", "device", "auto"])
def test_master_weights_on_gpu_with_delayed_copies(placement):
    """On the GPU, with the copies delayed: the masters land within torch's
    own AdamW kernels' spread of the hand-kept loop's on the GPU (the host's
    updates run the fused CPU kernel), every weight is its master's
    rounding, and the blocks stay within the budget."""
    from test_cuda import GPU, _sleepy

    model = TinyLM(d=128, n_layers=6).to(torch.bfloat16)
    start = copy.deepcopy(model)
    budget = regime_budget(model, "streams", state_factor=6)
    pager.wrap(model, budget=budget, device=GPU, optimizer_step=placement, master_weights=True,
               budget_covers="pager")  # (sized in blocks; the reference is on the GPU too)
    _sleepy(pager.of(model).transport, h2d_cycles=1_000_000, d2h_cycles=2_000_000)
    make = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    data = [(a.to(GPU), b.to(GPU)) for a, b in batches(6)]

    def run(m, o):
        train(m, o, data, clip=torch_clip, sched=scheduled(o))

    opt = make(model.parameters())
    run(model, opt)
    refs = []
    for kernel in ({"fused": True}, {"foreach": True}):
        ref = copy.deepcopy(start).to(GPU)
        refs.append(HandMasters(ref, functools.partial(make, **kernel)))
        run(ref, refs[-1])
    spread = max((a - b).abs().max().item() for a, b in zip(refs[0].masters, refs[1].masters))
    s = pager.of(model).stats()
    assert (s.host_steps > 0) == (placement == "host") or placement == "auto"
    # (on the host, the masters take one pass where it could be built: [Note: a master's update in one pass])
    assert (s.host_master_passes > 0) == (s.host_steps > 0) or master_pass.OnePass.kernel() is None
    assert s.peak_resident_bytes <= budget and s.evictions > 0
    for p, m in zip(model.parameters(), refs[1].masters):
        master = opt.state[p][MASTER]
        assert master.dtype == torch.float32 and opt.state[p]["exp_avg"].dtype == torch.float32
        assert (master.to(GPU) - m).abs().max().item() <= max(spread, 1e-5)
    with torch.no_grad():
        for p in model.parameters():
            assert torch.equal(p.to(GPU), opt.state[p][MASTER].to(GPU).to(torch.bfloat16))


def owners_with_masters(rank, world, tmp, optimizer_step):
    """Block owners ([Note: block owners]) with masters: each rank's masters
    and state only for the blocks it owns, the weights DDP's with hand-kept
    masters on every rank, bit for bit, and `state_dict()` gathers them."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from test_block_owners import assert_state_held_by_owners
    from test_data_parallel import assert_same_on_every_rank, rank_batches

    torch.manual_seed(100 + rank)  # (wrap broadcasts rank 0's weights)
    model = bf16_lm()
    ref = DDP(copy.deepcopy(model))
    pager.wrap(model, budget=regime_budget(model, "streams", state_factor=6), device="cpu", block_owners=True,
               optimizer_step=optimizer_step, master_weights=True)
    opt, ref_opt = OPTIMIZERS["adamw"](model.parameters()), HandMasters(ref.module, OPTIMIZERS["adamw"])
    for ids, tgt in rank_batches(rank, 4):
        for m, o in ((model, opt), (ref, ref_opt)):
            lm_loss(m, ids, tgt).backward()
            o.step()
            o.zero_grad()
    assert_same_on_every_rank(model)
    assert_models_equal(model, ref.module)
    assert_state_held_by_owners(model, opt)
    saved = opt.state_dict()["state"]  # (gathered from the owners: a collective)
    for i, m in enumerate(ref_opt.masters):
        assert_same(saved[i][MASTER], m.detach())
        assert_same(saved[i]["exp_avg"], ref_opt.state[m]["exp_avg"])
    assert dist.get_world_size() == world
    pager.unwrap(model)


@pytest.mark.parametrize("optimizer_step", ["host", "device"])
def test_block_owners_with_master_weights_equal_ddp_with_masters(tmp_path, optimizer_step):
    import os

    import torch.distributed as dist

    from test_data_parallel import spawn

    if not dist.is_available() or not os.path.isdir("/dev/shm"):
        pytest.skip("needs torch.distributed and /dev/shm (shared host pages)")
    spawn(owners_with_masters, 2, tmp_path, optimizer_step=optimizer_step)


@pytest.mark.parametrize("budget", ["streams", "tight"])
def test_adapters_of_a_frozen_bf16_model_train_on_masters(budget):
    """LoRA-style adapters on a frozen bf16 model ([Note: frozen pages]):
    the adapters get masters and float32 state, bit for bit the hand-kept
    loop, whether they stay on the device (a budget with room) or stream
    with their blocks."""
    from test_adapters import adapted_lm, trainable

    model = adapted_lm(torch.bfloat16)
    ref = copy.deepcopy(model)
    room = regime_budget(model, "streams", state_factor=6 if budget == "streams" else 0)
    pager.wrap(model, budget=room, device="cpu", master_weights=True)
    opt = OPTIMIZERS["adamw"](trainable(model))
    ref_opt = HandMasters(ref, OPTIMIZERS["adamw"])
    data = batches(5)
    train(model, opt, data)
    train(ref, ref_opt, data)
    assert_models_equal(model, ref)
    for p, m in zip(model.parameters(), ref_opt.masters):
        if p.requires_grad:
            assert_same(opt.state[p][MASTER], m.detach())
            assert opt.state[p]["exp_avg"].dtype == torch.float32


def test_master_weights_with_compressed_pages_and_with_the_disk_tier(tmp_path):
    """bf16 weights stored compressed ("lossless": a block stores plain once
    trained), and a model loaded from files under a host budget with its
    pages spilled to disk (updates on the device, the masters in the
    spilled state pages): both bit for bit the hand-kept loop."""
    st = pytest.importorskip("safetensors.torch")
    from test_disk import BIG, _layer_bytes, _meta, _state

    model = bf16_lm()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams", state_factor=6), device="cpu", compress="lossless",
               master_weights=True)
    runs = [(model, OPTIMIZERS["adamw"](model.parameters()), ref, HandMasters(ref, OPTIMIZERS["adamw"]))]

    ref = TinyLM(**BIG).to(torch.bfloat16)
    st.save_file(_state(ref), tmp_path / "model.safetensors")
    model, layer = _meta(**BIG).to(torch.bfloat16), _layer_bytes(ref)
    pager.load(model, tmp_path / "model.safetensors", budget=16 * layer + 8 * ref.embed.weight.nbytes + (1 << 20),
               device="cpu", host_budget=8 * layer, spill=tmp_path / "spill", master_weights=True)
    runs.append((model, OPTIMIZERS["adamw"](model.parameters()), ref, HandMasters(ref, OPTIMIZERS["adamw"])))
    for model, opt, ref, ref_opt in runs:
        data = batches(5)
        train(model, opt, data)
        train(ref, ref_opt, data)
        assert pager.of(model).stats().evictions > 0
        assert_models_equal(model, ref)
        assert_states_equal(opt, model, ref_opt)
    assert pager.of(runs[1][0]).stats().spills > 0
