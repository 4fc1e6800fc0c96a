"""A float32 master's Adam/AdamW update on the host in one pass ([Note: a
master's update in one pass] in training/master_pass.py): torch's fused CPU
kernel's arithmetic within its rounding (the C loop, and its reference in
torch ops), what it does not take left to the three passes untouched, and
pager's updates on the host running it."""

import copy
import functools

import pytest
import torch

import pager
from helpers import assert_models_equal, assert_same
from pager.training import master_pass
from pager.training.masters import MASTER
from test_masters import HandMasters, bf16_lm, scheduled
from test_training import batches, regime_budget, torch_clip, train

CASES = {
    "adamw": (torch.optim.AdamW, {"weight_decay": 0.1}),
    "adam_l2": (torch.optim.Adam, {"weight_decay": 0.01}),
    "adam_maximize": (torch.optim.Adam, {"maximize": True, "betas": (0.8, 0.99)}),
    "adamw_no_decay": (torch.optim.AdamW, {"weight_decay": 0.0, "eps": 1e-6}),
}


def built_or_skip():
    if master_pass.OnePass.kernel() is None:
        pytest.skip("the one pass cannot be built here (no C compiler: the warning says why); the three passes run")


def against_torch(cls, options, pass_fn, steps=5, n=4099):
    """Masters stepped by torch's fused CPU kernel on float32 gradients, and
    by `pass_fn(optimizer, group, master, state, bf16 grad, bf16 weight)`
    from the same state after the first step: (torch's, ours, our weight)."""
    gen = torch.Generator().manual_seed(0)
    theirs = torch.nn.Parameter(torch.randn(n, generator=gen))
    ours = theirs.detach().clone()
    weight = ours.to(torch.bfloat16)
    reference = cls([theirs], lr=1e-3, fused=True, **options)
    stand_in = cls([torch.zeros(1)], lr=1e-3, **options)  # (its class and options; its own state unused)
    state = None
    for i in range(steps):
        grad = torch.randn(n, generator=gen).to(torch.bfloat16)
        theirs.grad = grad.float()
        reference.step()
        if state is None:  # (the first update, elsewhere, made the state)
            state = {k: v.clone() for k, v in reference.state[theirs].items()}
            ours.copy_(theirs.detach())
            continue
        pass_fn(stand_in, stand_in.param_groups[0], ours, state, grad, weight)
    return theirs.detach(), ours, weight, state, reference.state[theirs]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("loop", ["c", "torch_ops"])
def test_one_pass_lands_within_torchs_fused_kernels_rounding(case, loop):
    """Four updates of a master from bf16 gradients, by the C loop (what
    runs) and by its reference in torch ops: within a few float32 ulps of
    torch's fused CPU AdamW/Adam, the moments too, the step counted, and
    the weight the master's rounding."""
    if loop == "c":
        built_or_skip()

        def pass_fn(optimizer, group, master, state, grad, weight):
            assert master_pass.update(optimizer, [(group, master, state, grad, weight)]) == {id(master)}
    else:
        def pass_fn(optimizer, group, master, state, grad, weight):
            state["step"] += 1
            c = master_pass.coefficients(group, float(state["step"]), master_pass.decoupled_decay(optimizer, group))
            master_pass.adam_pass(grad, master, state["exp_avg"], state["exp_avg_sq"], weight, torch.tensor(c))

    cls, options = CASES[case]
    theirs, ours, weight, state, their_state = against_torch(cls, options, pass_fn)
    torch.testing.assert_close(ours, theirs, rtol=4e-7, atol=1e-7)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(state[key], their_state[key], rtol=4e-7, atol=2e-7)
    assert float(state["step"]) == float(their_state["step"]) == 5
    assert torch.equal(weight, ours.to(torch.bfloat16))
    assert not torch.equal(ours, theirs.to(torch.bfloat16).float())  # (a master moves below a bf16 ulp)


def test_what_the_pass_does_not_take_is_left_untouched():
    """amsgrad, capturable, a non-contiguous page, no state yet, bf16
    moments, an fp16 parameter: `update` takes none of them and changes
    nothing (the three passes run them); of several, it takes those it can."""
    built_or_skip()
    n = 64
    optimizer = torch.optim.AdamW([torch.zeros(1)], lr=1e-3)
    group = optimizer.param_groups[0]

    def fresh():
        master = torch.randn(n)
        state = {"step": torch.tensor(1.0), "exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)}
        return master, state, torch.randn(n).to(torch.bfloat16), master.to(torch.bfloat16)

    refused = [
        lambda m, s, g, w: ({**group, "amsgrad": True}, m, s, g, w),
        lambda m, s, g, w: ({**group, "capturable": True}, m, s, g, w),
        lambda m, s, g, w: (group, m, s, torch.randn(n, 2).to(torch.bfloat16)[:, 0], w),
        lambda m, s, g, w: (group, m, {}, g, w),
        lambda m, s, g, w: (group, m, {**s, "exp_avg": s["exp_avg"].to(torch.bfloat16)}, g, w),
        lambda m, s, g, w: (group, m, s, g.to(torch.float16), w.to(torch.float16)),
    ]
    for make in refused:
        master, state, grad, weight = fresh()
        before = copy.deepcopy((master, state, weight))
        args = make(master, state, grad, weight)
        control = fresh()
        assert master_pass.update(optimizer, [args, (group, *control)]) == {id(control[0])}
        assert torch.equal(master, before[0]) and torch.equal(weight, before[2])
        assert all(torch.equal(state[k], before[1][k]) for k in state)
        assert float(control[1]["step"]) == 2 and torch.equal(control[3], control[0].to(torch.bfloat16))


class OnePassMasters(HandMasters):
    """The hand-kept loop with each update of the parameters at `paged`
    (their places in the model) after its first (which makes the state, on
    the device under pager) run as the one pass; the others' as torch's
    optimizer runs them."""

    def __init__(self, model, make, paged: list):
        super().__init__(model, make)
        self.paged = paged

    def step(self):
        if not self.state:
            return super().step()
        group = self.param_groups[0]
        items = [(group, self.masters[i].data, self.state[self.masters[i]], self.params[i].grad, self.params[i].data)
                 for i in self.paged]
        assert len(master_pass.update(self.inner, items)) == len(items)
        for i in self.paged:
            self.params[i].grad = None  # (the rest of the step passes over it)
        super().step()


@pytest.mark.parametrize("opt_name", ["adamw", "adam_l2"])
def test_updates_on_the_host_run_the_one_pass(opt_name, monkeypatch):
    """pager's updates on the host, given the fused kernels (a CUDA run's
    choice, made here on the CPU device): every master after its first
    update is updated in one pass, bit for bit the hand-kept loop that runs
    the pass (the gradients clipped, the learning rate scheduled)."""
    built_or_skip()
    cls, options = CASES[opt_name]
    make = functools.partial(cls, lr=1e-2, **options)
    model = bf16_lm()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams", state_factor=6), device="cpu",
               optimizer_step="host", master_weights=True)
    monkeypatch.setattr(pager.of(model).host_steps, "fused_on_host", lambda optimizer: True)
    in_blocks = {id(p) for b in pager.of(model).all_blocks() if not b.resident_for_life for p in b.params}
    paged = [i for i, p in enumerate(model.parameters()) if id(p) in in_blocks]
    opt, ref_opt = make(model.parameters()), OnePassMasters(ref, make, paged)
    data = batches(6)
    train(model, opt, data, clip=torch_clip, sched=scheduled(opt))
    train(ref, ref_opt, data, clip=torch_clip, sched=scheduled(ref_opt))
    s = pager.of(model).stats()
    assert s.host_steps > 0 and s.host_master_passes == 5 * len(paged)
    assert_models_equal(model, ref)
    for p, m in zip(model.parameters(), ref_opt.masters):
        assert_same(opt.state[p][MASTER], m.detach())
        assert_same(opt.state[p]["exp_avg_sq"], ref_opt.state[m]["exp_avg_sq"])
