"""Every tensor of a wrapped model is safe to touch, at any budget (CPU device,
bit for bit against an unwrapped twin): reads, writes, views, gradients,
torch's clip_grad_norm_ and GradScaler while blocks are paged out."""

import copy
import io
import random
import threading

import pytest
import torch
import torch.nn as nn

import pager
from helpers import assert_models_equal, assert_same
from models import TinyLM
from test_training import batches, lm_loss, regime_budget


def wrapped_pair(steps=2, opt=torch.optim.AdamW):
    """A TinyLM trained `steps` steps under a budget where a step's blocks do
    not fit, and its unwrapped twin trained the same way."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    opts = opt(model.parameters(), lr=1e-2), opt(ref.parameters(), lr=1e-2)
    for ids, tgt in batches(steps):
        for m, o in zip((model, ref), opts):
            lm_loss(m, ids, tgt).backward()
            o.step()
            o.zero_grad()
    return model, ref, opts


def page_out_everything(model, check=True):
    """Evict every block that may leave (what a tight budget does between steps)."""
    p = pager.of(model)
    with p.lock:
        for block in list(p.resident):
            if block.pins == 0 and not block.resident_for_life:
                p.engine.evict(block)
    assert not check or not p.blocks[1].weights.resident or p.blocks[1].resident_for_life


def weight(m):
    return m.layers[1].mlp[0].weight


def test_reading_a_paged_out_weight_fetches_it():
    model, ref, _ = wrapped_pair()
    page_out_everything(model)
    assert float(weight(model).sum()) == float(weight(ref).sum())
    assert pager.of(model).stats().on_demand >= 1
    # Identity, class and the optimizer's keys are unchanged throughout.
    w = weight(model)
    assert w is model.layers[1].mlp[0].weight and isinstance(w, nn.Parameter)
    assert type(w) is not nn.Parameter  # the guard, while its block is not in use
    seen = []
    model.layers[1].register_forward_pre_hook(lambda m, args: seen.append(type(m.mlp[0].weight)))
    with torch.no_grad():
        model(batches(1)[0][0])
    # In use: its own class's in-use twin (reading `.data` marks the block
    # dirty; [Note: the class of a tensor in use]); with other threads about,
    # the guard, which the thread using the block passes unserved ([Note:
    # tensors and threads]).
    in_use = pager.base.guards.in_use_class(nn.Parameter)
    assert seen == [type(w) if pager.of(model).shared_mode else in_use]
    assert in_use is not nn.Parameter and issubclass(in_use, nn.Parameter)
    assert in_use.__torch_function__ is torch._C._disabled_torch_function_impl  # the C++ path, as Parameter's
    page_out_everything(model)
    assert isinstance(weight(model), nn.Parameter) and weight(model) is w
    assert weight(model).shape == weight(ref).shape and weight(model).dtype == torch.float32
    assert not pager.of(model).blocks[1].weights.resident  # metadata did not fetch


def test_norms_of_every_parameter_and_an_ema():
    model, ref, _ = wrapped_pair()
    page_out_everything(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.norm(), q.norm())
    ema, ref_ema = copy.deepcopy(ref), copy.deepcopy(ref)
    for _ in range(2):
        page_out_everything(model)
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.lerp_(p, 0.1)
            for e, q in zip(ref_ema.parameters(), ref.parameters()):
                e.lerp_(q, 0.1)
    assert_models_equal(ema, ref_ema)


def test_an_in_place_write_to_a_paged_out_weight_is_kept():
    model, ref, _ = wrapped_pair()
    page_out_everything(model)
    with torch.no_grad():
        weight(model).mul_(0.5)
        weight(ref).mul_(0.5)
    ids = batches(1)[0][0]
    with torch.no_grad():
        page_out_everything(model)
        assert_same(model(ids), ref(ids))
    pager.unwrap(model)
    assert_models_equal(model, ref)


@pytest.mark.parametrize("how", ["data", "view", "detach", "index"])
def test_writes_through_data_and_views_are_kept(how):
    model, ref, _ = wrapped_pair()
    page_out_everything(model)
    with torch.no_grad():
        for m in (model, ref):
            w = weight(m)
            if how == "data":
                w.data.mul_(2.0)           # .data does not move the parameter's version counter
            elif how == "view":
                w.view(-1)[:7].fill_(0.25)
            elif how == "detach":
                w.detach().add_(1.0)
            else:
                w[3].copy_(torch.arange(w.shape[1], dtype=w.dtype))
    ids = batches(1)[0][0]
    with torch.no_grad():
        for _ in range(3):  # the block leaves and comes back between these
            page_out_everything(model)
            assert_same(model(ids), ref(ids))
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_a_view_kept_across_evictions_never_dangles():
    model, ref, _ = wrapped_pair()
    page_out_everything(model)
    view, data = weight(model)[2:4], weight(model).data  # taken while paged out
    ref_view, ref_data = weight(ref)[2:4], weight(ref).data
    ids = batches(1)[0][0]
    for _ in range(3):
        with torch.no_grad():
            model(ids)
        page_out_everything(model)
        assert_same(view.clone(), ref_view.clone())
        assert_same(data.sum(), ref_data.sum())
    data.mul_(3.0)  # a write through a .data kept across evictions
    ref_data.mul_(3.0)
    page_out_everything(model)
    with torch.no_grad():
        assert_same(model(ids), ref(ids))
    pager.unwrap(model)
    assert_models_equal(model, ref)
    with pytest.raises(RuntimeError, match="unwrap"):
        view.sum()  # its memory went with the pages: a clear error, not a crash


def test_copies_printing_saving_and_deepcopy_of_paged_out_tensors():
    model, ref, _ = wrapped_pair()
    page_out_everything(model)
    w, q = weight(model), weight(ref)
    assert_same(w.cpu(), q.cpu())
    assert_same(w.detach().clone(), q.detach().clone())
    assert str(w) == str(q) and repr(w) == repr(q)
    page_out_everything(model)
    array = w.detach().numpy()  # served while paged out: a read-only copy (a page cannot share memory)
    assert_same(torch.from_numpy(array.copy()), q.detach())
    with pytest.raises(ValueError, match="read-only"):
        array[0, 0] = 1.0
    page_out_everything(model)
    copied = copy.deepcopy(w)
    assert type(copied) is nn.Parameter and copied is not w
    assert_same(copied, q)
    page_out_everything(model)
    buf = io.BytesIO()
    torch.save(w, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert type(loaded) is nn.Parameter
    assert_same(loaded, q)
    page_out_everything(model)
    norm = model.layers[2].norm1.weight.tolist()  # a small one, through a different call path
    assert norm == ref.layers[2].norm1.weight.tolist()


def test_numpy_inside_a_blocks_use_keeps_it_on_the_cpu_device(pager_log):
    """`.numpy()` with the block in use (a hook on it) shares its memory, as
    without pager; on the CPU device such a block then stays resident."""
    model, ref, _ = wrapped_pair()
    arrays = []
    model.layers[1].register_forward_pre_hook(lambda m, args: arrays.append(m.norm1.weight.detach().numpy()))
    ids = batches(1)[0][0]
    with torch.no_grad():
        model(ids)
    page_out_everything(model, check=False)
    assert pager.of(model).blocks[1].weights.resident and "numpy" in pager_log.text
    arrays[0][0] = 5.0  # a write through it reaches the model, as without pager
    with torch.no_grad():
        ref.layers[1].norm1.weight[0] = 5.0
        assert_same(model(ids), ref(ids))


def test_assigning_data_of_a_parameter():
    model, ref, _ = wrapped_pair()
    page_out_everything(model)
    w = weight(model)
    with pytest.raises(RuntimeError, match=r"\.data.*outside its block's use.*copy_"):
        w.data = torch.zeros(w.shape)
    assert_same(w, weight(ref))  # nothing changed
    # `.data` changed in place and given back (peft's LoRA merge: `w.data += delta`) is the write it is.
    for _ in range(2):
        page_out_everything(model)
        w.data += 0.25
        weight(ref).data += 0.25
    # Inside the block's use (a hook on it), `.data =` is the plain assignment;
    # the new value goes into the page when the block leaves.
    ids = batches(1)[0][0]
    done = []

    def assign(module, args):
        if not done:
            done.append(1)
            module.mlp[0].weight.data = torch.full(w.shape, 0.5)

    model.layers[1].register_forward_pre_hook(assign)
    with torch.no_grad():
        model(ids)
        weight(ref).data = torch.full(w.shape, 0.5)
        for _ in range(2):
            page_out_everything(model)
            assert_same(model(ids), ref(ids))
    pager.unwrap(model)
    assert_models_equal(model, ref)


class StemAndLayers(nn.Module):
    """A stem with BatchNorm (the remainder, resident: `_apply` converts it
    first) before layers that page."""

    def __init__(self, d=32, n_layers=6):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(8, d), nn.BatchNorm1d(d))
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.BatchNorm1d(d), nn.ReLU())
                                    for _ in range(n_layers))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_conversion_of_the_wrapped_model():
    """`model.to()` to the device and dtype it has changes nothing (a loop
    that moves its model, as trainers do, runs); one to another dtype is
    refused by the first paged-out tensor, and what was converted before it
    (the resident remainder's parameters, gradients and BatchNorm buffers)
    is put back: the model trains on as the unwrapped one, bit for bit
    ([Note: a refused conversion leaves the model as it was] in
    base/conversions.py)."""
    model = StemAndLayers()
    ref = copy.deepcopy(model)
    layer_bytes = sum(t.numel() * t.element_size() for t in model.layers[0].state_dict().values())
    pager.wrap(model, budget=8 * layer_bytes + 40000, device="cpu", blocks=list(model.layers))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))

    def step(m, opt, zero=True):
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        if zero:
            opt.zero_grad()

    for m, opt in zip((model, ref), opts):
        step(m, opt)
        step(m, opt, zero=False)  # (gradients present for the conversion)
    assert pager.of(model).stats().evictions > 0
    assert model.to("cpu") is model and model.cpu().float() is model
    with pytest.raises(RuntimeError, match=r"dtype and device stay as wrap made them.*tensors changed before"):
        model.to(torch.float16)
    for (name, t), (_n, r) in zip(list(model.named_parameters()) + list(model.named_buffers()),
                                  list(ref.named_parameters()) + list(ref.named_buffers())):
        assert t.dtype == r.dtype, name
        assert_same(t, r)
        assert t.grad is None or (t.grad.dtype == r.grad.dtype and torch.equal(t.grad, r.grad)), name
    for m, opt in zip((model, ref), opts):
        opt.zero_grad()
        for _ in range(3):
            step(m, opt)
    assert_models_equal(model, ref)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_gradients_read_after_backward():
    model, ref, _ = wrapped_pair(steps=1)
    ids, tgt = batches(2)[1]
    for m in (model, ref):
        lm_loss(m, ids, tgt).backward()
    grads = [p.grad for p in model.parameters()]
    assert any(type(g).__name__ == "PagedOutGrad" for g in grads)  # some left with their block
    for p, q in zip(model.parameters(), ref.parameters()):
        paged_out = type(p.grad).__name__ == "PagedOutGrad"
        assert_same(p.grad.clone(), q.grad)
        assert_same(p.grad.norm(), q.grad.norm())
        if paged_out:  # printed and read as numpy: the gradient it stands for
            assert str(p.grad) == str(q.grad) and f"{p.grad}" == f"{q.grad}"
            assert (p.grad.numpy() == q.grad.numpy()).all()
    print(weight(model).grad)  # printing a gradient works


def test_torch_clip_grad_norm_at_a_budget_where_the_step_does_not_fit():
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    on_demand = []
    for step, (ids, tgt) in enumerate(batches(6)):
        for m, o in ((model, opt), (ref, ref_opt)):
            lm_loss(m, ids, tgt).backward()
            before = pager.of(model).stats().on_demand if m is model else None
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            if m is model:
                on_demand.append(pager.of(model).stats().on_demand - before)
                model_norm = norm
            else:
                assert_same(model_norm, norm)
            o.step()
            o.zero_grad(set_to_none=bool(step % 2))
    # Gradients leave with their norms from the first backward on: no clip,
    # the first included, fetches anything.
    assert on_demand == [0] * len(on_demand), on_demand
    assert pager.of(model).stats().evictions > 0
    pager.unwrap(model)
    assert_models_equal(model, ref)


@pytest.mark.parametrize("init_scale", [2.0**10, 1000.0])
def test_grad_scaler_at_a_budget_where_the_step_does_not_fit(init_scale):
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    scalers = [torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2) for _ in range(2)]
    data = batches(8)
    on_demand = []
    for step, (ids, tgt) in enumerate(data):
        for m, o, scaler in ((model, opt, scalers[0]), (ref, ref_opt, scalers[1])):
            loss = lm_loss(m, ids, tgt)
            if step == 3:
                loss = loss * float("inf")  # an overflowing step: skipped by both
            scaler.scale(loss).backward()
            before = pager.of(model).stats().on_demand
            scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            if m is model:
                on_demand.append(pager.of(model).stats().on_demand - before)
            scaler.step(o)
            scaler.update()
            o.zero_grad()
        assert scalers[0].get_scale() == scalers[1].get_scale()
    assert scalers[0].get_scale() != init_scale  # it grew and backed off
    if init_scale == 2.0**10:
        # Powers of two (GradScaler's own scales) keep the norms exact:
        # unscaling and clipping move no bytes, from the first step on. Other
        # scales are served by fetching on the CPU device, whose results are bitwise.
        assert on_demand == [0] * len(on_demand), on_demand
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_a_trainer_style_loop_runs_unchanged():
    """Like Hugging Face's Trainer: accumulation, GradScaler, torch's clip, a
    scheduler, and logging of weight and gradient norms every step."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    logs = {}
    for m in (model, ref):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        log = logs.setdefault(id(m), [])
        for step, (ids, tgt) in enumerate(batches(8)):
            loss = lm_loss(m, ids, tgt) / 2
            scaler.scale(loss).backward()
            if step % 2 == 0:
                continue  # accumulate two micro-batches
            scaler.unscale_(opt)
            grad_norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=True)
            weight_norm = torch.stack([p.norm() for p in m.parameters()]).norm()
            log.append((float(grad_norm), float(weight_norm), float(loss)))
    assert logs[id(model)] == logs[id(ref)]
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_tensors_read_from_several_threads():
    model, ref, _ = wrapped_pair()
    page_out_everything(model)
    expected = [q.detach().sum() for q in ref.parameters()]
    errors = []

    def reader(seed):
        rng = random.Random(seed)
        params = list(model.parameters())
        try:
            for _ in range(40):
                i = rng.randrange(len(params))
                assert_same(params[i].sum(), expected[i])
                if rng.random() < 0.3:
                    page_out_everything(model, check=False)  # while other threads read
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(b.pins == b.resident_for_life for b in pager.of(model).all_blocks())


def test_a_term_built_outside_the_forward_trains():
    """An L2 penalty over every parameter, computed outside the model's forward
    (the blocks are paged out then), backpropagates into the right gradients."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    opts = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for ids, tgt in batches(3):
        for m, o in zip((model, ref), opts):
            loss = lm_loss(m, ids, tgt)
            loss = loss + 1e-3 * sum(p.pow(2).sum() for p in m.parameters())
            loss.backward()
            o.step()
            o.zero_grad()
    pager.unwrap(model)
    assert_models_equal(model, ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_sequences_of_steps_reads_writes_and_evictions(seed, tmp_path):
    """A long random mix of what users do, against an unwrapped twin."""
    rng = random.Random(seed)
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    opts = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**6) for _ in range(2)]
    data = batches(30, generator=torch.Generator().manual_seed(seed))
    actions = ["backward", "step", "clip", "zero", "zero_none", "read", "write", "data_write", "grad_read",
               "evict", "checkpoint", "scaled_step", "eval"]
    for i in range(60):
        action = rng.choice(actions)
        k = rng.randrange(len(list(ref.parameters())))
        ids, tgt = data[i % len(data)]
        for m, o, scaler in zip((model, ref), opts, scalers):
            p = list(m.parameters())[k]
            if action == "backward":
                lm_loss(m, ids, tgt).backward()
            elif action == "step":
                o.step()
            elif action == "clip":
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
            elif action in ("zero", "zero_none"):
                o.zero_grad(set_to_none=action == "zero_none")
            elif action == "read":
                value = p.sum() if m is model else None
                if m is ref:
                    assert_same(got, p.sum())
                got = value
            elif action == "write":
                with torch.no_grad():
                    p.mul_(0.99)
            elif action == "data_write":
                p.data.add_(0.001)
            elif action == "grad_read":
                value = None if p.grad is None else p.grad.clone()
                if m is ref:
                    assert (got is None) == (value is None)
                    if value is not None:
                        assert_same(got, value)
                got = value
            elif action == "evict" and m is model:
                page_out_everything(model)
            elif action == "checkpoint":
                path = tmp_path / f"{id(m)}.pt"
                torch.save({"model": m.state_dict(), "opt": o.state_dict()}, path)
                ckpt = torch.load(path)
                m.load_state_dict(ckpt["model"])
                o.load_state_dict(ckpt["opt"])
            elif action == "scaled_step":
                scaler.scale(lm_loss(m, ids, tgt)).backward()
                scaler.unscale_(o)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                scaler.step(o)
                scaler.update()
            elif action == "eval":
                with torch.no_grad():
                    out = m(ids)
                if m is ref:
                    assert_same(got, out)
                got = out
    pager.unwrap(model)
    assert_models_equal(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            assert_same(p.grad, q.grad)


def test_a_write_through_data_inside_the_blocks_forward_survives_its_eviction():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    ref = copy.deepcopy(model)
    one = sum(t.numel() * t.element_size() for t in model[0].state_dict().values())
    pager.wrap(model, budget=2 * one + 4096, device="cpu")
    def prune(module, args):  # a mask applied in place at each call, as some pruning libraries do
        module.weight.data.mul_(0.5)

    for net in (model, ref):
        net[2].register_forward_pre_hook(prune)
    x = torch.randn(2, 32)
    with torch.no_grad():
        for _ in range(3):
            assert_same(model(x), ref(x))
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_a_tensor_in_use_copies_and_pickles_as_its_own_class():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))
    pager.wrap(model, budget="1MiB", device="cpu", blocks=[model[0], model[1], model[2]])
    made = {}

    def inside(module, args):  # while the block is in use
        made["copy"] = copy.deepcopy(module.weight)
        made["buffer"] = copy.deepcopy(module.running_mean)
        buf = io.BytesIO()
        torch.save({"w": module.weight, "mean": module.running_mean}, buf)
        made["saved"] = buf.getvalue()

    model[1].register_forward_pre_hook(inside)
    model.eval()
    with torch.no_grad():
        model(torch.randn(4, 8))
    assert type(made["copy"]) is nn.Parameter and type(made["buffer"]) is torch.Tensor
    assert_same(made["copy"], model[1].weight) and made["copy"] is not model[1].weight
    loaded = torch.load(io.BytesIO(made["saved"]), weights_only=True)
    assert type(loaded["w"]) is nn.Parameter and type(loaded["mean"]) is torch.Tensor
    assert_same(loaded["mean"], model[1].running_mean)
    pager.unwrap(model)
    assert type(model[1].weight) is nn.Parameter and type(model[1].running_mean) is torch.Tensor


def test_fetches_on_demand_warn_once_a_model_and_are_counted(caplog):
    """Reading every paged-out block's weights logs one warning (the first),
    not one per block; each fetch is counted in stats().on_demand."""
    model, _ref, _opts = wrapped_pair()
    page_out_everything(model)
    pg = pager.of(model)
    before = pg.stats().on_demand
    with caplog.at_level("WARNING", logger="pager"):
        for layer in model.layers:
            layer.mlp[0].weight.sum()
    warned = [r for r in caplog.records if "fetched on demand" in r.getMessage()]
    assert len(warned) == 1
    assert pg.stats().on_demand - before == len(model.layers)
