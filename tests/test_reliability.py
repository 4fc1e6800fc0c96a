"""Bad input gets a clear error before anything changes; faults leave the
pager consistent; nothing is lost."""

import copy
import random
import threading

import pytest
import torch
import torch.nn as nn

import pager
from helpers import assert_models_equal, assert_same, tensor_page_bytes
from models import TinyLM
from test_training import batches, lm_loss, regime_budget


def snapshot(model):
    return {n: (t.data_ptr(), t.detach().clone()) for n, t in model.state_dict(keep_vars=True).items()}


def assert_untouched(model, snap):
    for n, t in model.state_dict(keep_vars=True).items():
        assert t.data_ptr() == snap[n][0], n
        assert_same(t.detach(), snap[n][1])
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    from pager.base.common import _PAGERS

    assert model not in _PAGERS


def consistent(model):
    """No pins left, accounting equals what is resident, groups intact."""
    pg = pager.of(model)
    for b in pg.all_blocks():
        assert b.pins == (1 if b.resident_for_life else 0), b
    assert pg.resident_bytes == sum(b.device_bytes() for b in pg.all_blocks())
    assert pg.resident_bytes <= pg.budget_bytes
    assert not pg.hooks.backward_holds


# ------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "option, match",
    [({"prefetch": -1}, "prefetch=-1 must be a whole number"), ({"defer_step": "yes"}, "defer_step='yes' must be True")],
)
def test_bad_options_are_refused_before_anything_changes(option, match):
    model = TinyLM()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=match):
        pager.wrap(model, budget=1 << 30, device="cpu", **option)
    assert_untouched(model, snap)


def test_auto_budget_with_too_little_free_memory(monkeypatch):
    import pager.base.budget as budget_mod

    monkeypatch.setattr(budget_mod, "device_memory", lambda device: (512 << 20, 16 << 30))
    model = TinyLM()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r'"auto" found only 512.00 MiB free'):
        pager.wrap(model, budget="auto", device="cpu")
    assert_untouched(model, snap)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_cuda_without_cuda():
    with pytest.raises(ValueError, match='CUDA is not available here; use device="cpu"'):
        pager.wrap(TinyLM(), budget="1GiB", device="cuda")


def test_not_a_device():
    with pytest.raises(ValueError, match="not a device"):
        pager.wrap(TinyLM(), budget="1GiB", device="gpu0")


def test_meta_model_is_refused():
    with torch.device("meta"):
        model = TinyLM()
    with pytest.raises(ValueError, match="meta device.*to_empty"):
        pager.wrap(model, budget="1GiB", device="cpu")


def test_sparse_parameter_is_refused():
    model = TinyLM()
    model.layers[0].sparse = nn.Parameter(torch.sparse_coo_tensor([[0]], [1.0], (4,), check_invariants=True))
    snap = {n: t for n, t in model.named_parameters()}
    with pytest.raises(ValueError, match="layers.0.sparse.*sparse_coo.*dense"):
        pager.wrap(model, budget="1GiB", device="cpu")
    assert all(t is snap[n] for n, t in model.named_parameters())


def test_wrapping_twice_and_nested_wrapping():
    model = TinyLM()
    pager.wrap(model, budget="1GiB", device="cpu")
    with pytest.raises(ValueError, match="already wrapped"):
        pager.wrap(model, budget="1GiB", device="cpu")
    with pytest.raises(ValueError, match="submodule of a wrapped TinyLM"):
        pager.wrap(model.layers[0], budget="1GiB", device="cpu")
    outer = nn.Sequential(model, nn.Linear(64, 2))
    with pytest.raises(ValueError, match="contains a wrapped TinyLM"):
        pager.wrap(outer, budget="1GiB", device="cpu")


def test_predicate_matching_nothing():
    model = TinyLM()
    snap = snapshot(model)
    with pytest.raises(ValueError, match="matched no module"):
        pager.wrap(model, budget="1GiB", device="cpu", blocks=lambda n, m: False)
    assert_untouched(model, snap)


def test_not_enough_host_memory_fails_before_pinning(monkeypatch):
    import psutil

    real = psutil.virtual_memory()

    class Small:
        available = 1 << 20
        total = real.total

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Small)
    model = TinyLM()
    snap = snapshot(model)
    with pytest.raises(MemoryError, match="needs .* of host memory.*only 1.00 MiB is available"):
        pager.wrap(model, budget="1GiB", device="cpu")
    assert_untouched(model, snap)


def test_non_contiguous_and_mixed_dtype_parameters():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            with torch.no_grad():
                self.layers[1].weight = nn.Parameter(torch.randn(8, 8).t())  # non-contiguous
            self.layers[2].half_scale = nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
            self.layers[2].register_buffer("count", torch.tensor(3, dtype=torch.int64))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x * self.layers[2].half_scale.float() + self.layers[2].count

    model = Odd()
    assert not model.layers[1].weight.is_contiguous()
    ref = copy.deepcopy(model)
    # Room for about two blocks with their gradients and Adam state: they stream.
    pager.wrap(model, budget=9 * tensor_page_bytes(model.layers[2]), device="cpu")
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=0.1), torch.optim.Adam(ref.parameters(), lr=0.1)
    for _ in range(4):
        x = torch.randn(4, 8)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_a_submodule_called_directly_fetches_its_block():
    model = TinyLM().eval()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=pager.plan(model, "1GiB", device="cpu").min_budget_bytes, device="cpu")
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 8)))  # layers.0 is paged out now
        assert not pager.of(model).blocks[0].weights.resident
        assert_same(model.layers[0].mlp(x), ref.layers[0].mlp(x))
        assert_same(model.layers[0].attn.qkv(x), ref.layers[0].attn.qkv(x))
    consistent(model)


class _Gated(nn.Module):
    """A module with a weight whose forward, when `hold` is set, says it
    entered and waits to be let go (a direct call held open)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d))
        self.hold = None

    def forward(self, x):
        hold = self.hold
        if hold is not None:
            hold[0].set()
            hold[1].wait(10)
        return x @ self.weight


class _GatedBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gate = _Gated(d)

    def forward(self, x):
        return self.gate(x)


def test_a_block_used_during_a_direct_call_into_it_from_another_thread_is_let_go_after_both():
    """A module inside a paged-out block, called on its own in one thread,
    while another runs the model through that block: the block is let go
    once both are done (its guards stay on while a direct call is open:
    taken off, the call's end would not release it)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_GatedBlock(16) for _ in range(4)])
    pager.wrap(model, budget=2 * tensor_page_bytes(model[0]), device="cpu", blocks=list(model))
    p = pager.of(model)
    x = torch.randn(2, 16)
    with torch.no_grad():
        model(x)
        assert not p.blocks[0].weights.resident  # streamed: paged out
        want = x @ model[0].gate.weight.detach().clone()
        hold, out = (threading.Event(), threading.Event()), []
        model[0].gate.hold = hold
        direct = threading.Thread(target=lambda: out.append(model[0].gate(x)))
        direct.start()
        assert hold[0].wait(10)  # the direct call has the block and waits
        model[0].gate.hold = None
        model(x)  # the model's own use of that block, meanwhile
        hold[1].set()
        direct.join(10)
        assert_same(out[0], want)
        assert [b.pins for b in p.blocks] == [0, 0, 0, 0]
        left = p.blocks[0].stats.evictions
        model(x)
        model(x)
        assert p.blocks[0].stats.evictions > left  # it streams again


def test_a_submodule_called_directly_trains():
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=pager.plan(model, "1GiB", device="cpu").min_budget_bytes * 4, device="cpu")
    x = torch.randn(2, 8, 32)
    for m in (model, ref):
        m(torch.randint(0, 64, (2, 8)))
        m.layers[0].mlp(x).sum().backward()
    for p, q in zip(model.layers[0].mlp.parameters(), ref.layers[0].mlp.parameters()):
        pager.of(model).uses.acquire(pager.of(model).blocks[0], ("weights", "grads"), record=False)
        assert_same(p.grad, q.grad)
        pager.of(model).uses.release(pager.of(model).blocks[0])


def test_replaced_parameter_or_added_module_is_refused():
    model = TinyLM()
    pager.wrap(model, budget="1GiB", device="cpu")
    ids = torch.randint(0, 64, (2, 8))
    model.layers[1].norm1.weight = nn.Parameter(torch.ones(32))
    with pytest.raises(RuntimeError, match=r"'layers.1.norm1.weight' was added or replaced after wrap.*unwrap"):
        model(ids)
    model2 = TinyLM()
    pager.wrap(model2, budget="1GiB", device="cpu")
    model2.layers[0].extra = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="layers.0.extra.weight"):
        model2(ids)


# ------------------------------------------------------------------ faults
class Faulty(nn.Module):
    """A decoder whose layers can raise in forward or in backward on demand."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.fail_forward_at = None
        self.fail_backward_at = None
        self.exc = RuntimeError

    def forward(self, ids):
        x = self.base.embed(ids)
        for i, layer in enumerate(self.base.layers):
            x = layer(x)
            if i == self.fail_forward_at:
                raise self.exc(f"injected in forward of layer {i}")
            if i == self.fail_backward_at:
                x = _RaiseInBackward.apply(x)
        return self.base.head(self.base.norm(x))


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("injected in backward")


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_exception_in_forward_leaves_pager_consistent(exc):
    model = TinyLM()
    ref = copy.deepcopy(model)
    faulty = Faulty(model)
    pager.wrap(faulty, budget=regime_budget(model, "streams"), device="cpu")
    faulty.exc = exc
    faulty.fail_forward_at = 3
    with pytest.raises(exc):
        faulty(torch.randint(0, 64, (2, 8)))
    consistent(faulty)
    faulty.fail_forward_at = None
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert_same(faulty(ids), ref(ids))
    pager.unwrap(faulty)
    assert_models_equal(model, ref)


def test_a_forward_interrupted_by_keyboardinterrupt_leaves_no_hooks_on_for_later_autograd(caplog):
    """A KeyboardInterrupt skips the root's always-called post-hook ([Note: a
    forward interrupted] in model/hooks.py): the next forward ends what it
    left, so pager's saved-tensor hooks are not left on for every later
    autograd op of the thread, and training goes on equal to unwrapped."""
    from pager.base import saving

    model = TinyLM()
    ref = copy.deepcopy(model)
    faulty = Faulty(model)
    pager.wrap(faulty, budget=regime_budget(model, "streams"), device="cpu")
    for m in (faulty, ref):  # (measured before its first pass: the next one is not, and runs at once)
        lm_loss(m, *batches(1)[0]).backward()
    faulty.exc, faulty.fail_forward_at = KeyboardInterrupt, 1
    with pytest.raises(KeyboardInterrupt):
        faulty(torch.randint(0, 64, (2, 8)))
    faulty.fail_forward_at = None
    with caplog.at_level("WARNING", logger="pager"):
        ids, tgt = batches(1)[0]
        loss, ref_loss = lm_loss(faulty, ids, tgt), lm_loss(ref, ids, tgt)
    assert "interrupted" in caplog.text
    assert saving._top_hooks() is None and saving.depth() == 0 and pager.of(faulty).hooks.root_depth == 0
    loss.backward()
    ref_loss.backward()
    consistent(faulty)
    pager.unwrap(faulty)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.grad, q.grad)


def test_exception_in_backward_then_training_goes_on():
    model = TinyLM()
    ref = copy.deepcopy(model)
    faulty = Faulty(model)
    pager.wrap(faulty, budget=regime_budget(model, "streams"), device="cpu")
    opt, ref_opt = torch.optim.AdamW(faulty.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    faulty.fail_backward_at = 2
    ids, tgt = batches(1)[0]
    with pytest.raises(RuntimeError, match="injected in backward"):
        lm_loss(faulty, ids, tgt).backward()
    opt.zero_grad()  # the failed step's partial gradients are dropped
    faulty.fail_backward_at = None
    for ids, tgt in batches(3):
        for m, o in ((faulty, opt), (ref, ref_opt)):
            lm_loss(m, ids, tgt).backward()
            o.step()
            o.zero_grad()
    consistent(faulty)
    pager.unwrap(faulty)
    assert_models_equal(model, ref)


def test_exception_inside_the_streamed_step(monkeypatch):
    from pager.training.optim import OptimizerLink

    model = TinyLM()
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    lm_loss(model, *batches(1)[0]).backward()
    groups_before = [list(g["params"]) for g in opt.param_groups]
    calls = []
    real = OptimizerLink._step_once

    def failing(self, optimizer):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected in step")
        real(self, optimizer)

    monkeypatch.setattr(OptimizerLink, "_step_once", failing)
    with pytest.raises(RuntimeError, match="injected in step"):
        opt.step()
    assert [list(g["params"]) for g in opt.param_groups] == groups_before
    consistent(model)
    monkeypatch.setattr(OptimizerLink, "_step_once", real)
    opt.zero_grad()
    lm_loss(model, *batches(1)[0]).backward()
    opt.step()
    consistent(model)


def test_out_of_memory_while_fetching_evicts_and_retries(monkeypatch, caplog):
    model = TinyLM().eval()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget="1GiB", device="cpu")
    pg = pager.of(model)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        model(ids)  # everything resident
    transport = pg.transport
    real = transport.allocate
    failures = {"left": 1}

    def flaky(flat, nbytes):
        if failures["left"]:
            failures["left"] -= 1
            raise torch.cuda.OutOfMemoryError("injected")
        real(flat, nbytes)

    monkeypatch.setattr(transport, "allocate", flaky)
    pg.engine.evict(pg.blocks[2])
    with torch.no_grad():
        assert_same(model(ids), ref(ids))
    assert "evicted idle blocks and retried" in caplog.text
    consistent(model)
    failures["left"] = 10
    pg.engine.evict(pg.blocks[4])
    with pytest.raises(pager.BudgetError, match="out of device memory fetching 'layers.4'.*even after evicting"):
        with torch.no_grad():
            model(ids)
    consistent(model)


def test_two_threads_forward_on_one_model():
    model = TinyLM().eval()
    ref = copy.deepcopy(model)
    pg_budget = 4 * pager.plan(model, "1GiB", device="cpu").min_budget_bytes
    pager.wrap(model, budget=pg_budget, device="cpu")
    errors, wrong = [], []

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(30):
            ids = torch.randint(0, 64, (2, 8), generator=g)
            try:
                with torch.no_grad():
                    y = model(ids)
                    if not torch.equal(y, ref(ids)):
                        wrong.append(seed)
            except pager.BudgetError as e:
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    consistent(model)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_fault_injection_at_random_points_keeps_parity():
    """Over many iterations, raise at a random layer in forward or backward
    or before the step; a faulted iteration is dropped (zero_grad) by the
    paged model, and never run by the reference. Afterwards: equal."""
    rng = random.Random(7)
    model = TinyLM()
    ref = copy.deepcopy(model)
    faulty = Faulty(model)
    pager.wrap(faulty, budget=regime_budget(model, "streams"), device="cpu")
    opt, ref_opt = torch.optim.AdamW(faulty.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    fail_step = {"now": False}

    def maybe_fail(optimizer, args, kwargs):
        if fail_step["now"]:
            raise RuntimeError("injected before step")

    opt.register_step_pre_hook(maybe_fail)
    faults = 0
    for ids, tgt in batches(30):
        where = rng.choice(["none", "none", "forward", "backward", "step"])
        faulty.fail_forward_at = rng.randrange(6) if where == "forward" else None
        faulty.fail_backward_at = rng.randrange(6) if where == "backward" else None
        fail_step["now"] = where == "step"
        try:
            lm_loss(faulty, ids, tgt).backward()
            opt.step()
        except RuntimeError as e:
            assert "injected" in str(e)
            faults += 1
            opt.zero_grad()
            continue
        opt.zero_grad()
        lm_loss(ref, ids, tgt).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert faults >= 10
    consistent(faulty)
    pager.unwrap(faulty)
    assert_models_equal(model, ref)


def test_unfreezing_after_wrap_is_refused_and_freezing_is_fine():
    model = TinyLM()
    for p in model.layers[2].parameters():
        p.requires_grad_(False)
    pager.wrap(model, budget="1GiB", device="cpu")
    ids = torch.randint(0, 64, (2, 8))
    model.layers[4].norm1.weight.requires_grad_(False)  # freezing more is fine
    model(ids)
    model.layers[2].mlp[0].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"'layers.2.mlp.0.weight' was frozen at wrap.*unwrap"):
        model(ids)
