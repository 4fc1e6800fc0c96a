"""Optimizer updates on the host ([Note: the optimizer step on the host] in
training/host_step.py), on the CPU device: bit for bit the unwrapped model."""

import copy
import functools
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import pager
from helpers import assert_models_equal
from models import SuperNet, TinyLM
from test_training import (_opt_states_equal, _supernet_budget, batches, lm_loss, regime_budget, torch_clip, train,
                           train_supernet)

OPTIMIZERS = {
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
    "adam_fused": functools.partial(torch.optim.Adam, lr=1e-2, weight_decay=0.01, fused=True),
    "sgd_momentum": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=0.01),
    "sgd": functools.partial(torch.optim.SGD, lr=0.05),
    "rmsprop": functools.partial(torch.optim.RMSprop, lr=1e-3, momentum=0.5),
    "adagrad": functools.partial(torch.optim.Adagrad, lr=1e-2),
}


def updates(model, steps) -> int:
    """Block updates a run of `steps` steps makes (every trainable block, each step)."""
    return steps * sum(1 for b in pager.of(model).all_blocks() if b.trainable)


@pytest.mark.parametrize("placement", ["host", "auto"])
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_updates_on_the_host_equal_the_unwrapped_model(opt_name, placement):
    """Accumulation, torch's clip_grad_norm_ and an LR schedule, zero_grad
    both ways: every update on the host ("host"), or the paged-out blocks'
    there and the resident ones' on the device ("auto")."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu", optimizer_step=placement)
    opt, ref_opt = OPTIMIZERS[opt_name](model.parameters()), OPTIMIZERS[opt_name](ref.parameters())
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ref_opt)]
    data = batches(7)
    train(model, opt, data, clip=torch_clip, sched=scheds[0])
    train(ref, ref_opt, data, clip=torch_clip, sched=scheds[1])
    s = pager.of(model).stats()
    assert s.host_steps > 0
    if placement == "auto":
        assert s.host_steps < updates(model, len(data)) - len(data)  # (the first step's are all on the device)
    pager.unwrap(model)
    assert_models_equal(model, ref)
    _opt_states_equal(opt, ref_opt, model, ref)


def test_grad_scaler_with_updates_on_the_host():
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu", optimizer_step="host")
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1000.0, growth_interval=2) for _ in range(2)]
    data = batches(6)
    for step, (ids, tgt) in enumerate(data):
        for m, o, scaler in ((model, opt, scalers[0]), (ref, ref_opt, scalers[1])):
            loss = lm_loss(m, ids, tgt) * (float("inf") if step == 3 else 1.0)  # step 3 overflows: skipped
            scaler.scale(loss).backward()
            scaler.unscale_(o)
            torch_clip(m)
            scaler.step(o)
            scaler.update()
            o.zero_grad()
        assert scalers[0].get_scale() == scalers[1].get_scale()
    assert pager.of(model).stats().host_steps > 0
    pager.unwrap(model)
    assert_models_equal(model, ref)
    _opt_states_equal(opt, ref_opt, model, ref)


def test_a_checkpoint_taken_while_updates_run_resumes_bit_for_bit():
    """state_dict() waits for the updates in flight; loading the checkpoint
    and redoing the steps gives the same model."""
    model = TinyLM()
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu", optimizer_step="host")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = batches(8)
    train(model, opt, data[:4], accumulate=False)
    assert pager.of(model).host_steps._running  # updates of the last step.. maybe still running
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, data[4:], accumulate=False)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    train(model, opt, data[4:], accumulate=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, first[k]), k


def test_a_supernet_with_unused_candidates_updates_on_the_host():
    net = SuperNet(n_layers=4)
    ref = copy.deepcopy(net)
    pager.wrap(net, budget=_supernet_budget(net), device="cpu", optimizer_step="host")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (net, ref))
    train_supernet(net, ref, opt, ref_opt, batches(8), torch.Generator().manual_seed(3),
                   len(net.layers[0].candidates))
    assert pager.of(net).stats().host_steps > 0
    pager.unwrap(net)
    assert_models_equal(net, ref)
    _opt_states_equal(opt, ref_opt, net, ref)


class SlowSGD(torch.optim.SGD):
    """SGD whose updates take a while (on the host: the next forward must wait)."""

    def step(self, closure=None):
        time.sleep(0.02)
        return super().step(closure)


class GatedSGD(torch.optim.SGD):
    """SGD whose updates on the host (pager's worker thread) wait until `gate` is set."""

    gate = threading.Event()

    def step(self, closure=None):
        if threading.current_thread().name.startswith("pager-"):
            assert self.gate.wait(timeout=60)
        return super().step(closure)


def _gated_pair():
    """A streamed TinyLM updated on the host by `GatedSGD` (the gate open),
    and its twin updated by `SlowSGD`, with their optimizers."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams", state_factor=1), device="cpu", optimizer_step="host")
    opt, ref_opt = GatedSGD(model.parameters(), lr=0.05, momentum=0.9), SlowSGD(ref.parameters(), lr=0.05,
                                                                                momentum=0.9)
    GatedSGD.gate.set()
    return model, ref, opt, ref_opt


def test_the_next_use_waits_for_a_slow_update_on_the_host():
    """The last step's updates are held back on the host (gated) while the
    next forward runs: its fetches wait for them, and it computes with the
    updated weights."""
    model, ref, opt, ref_opt = _gated_pair()
    data = batches(5)
    train(model, opt, data[:4], accumulate=False)
    train(ref, ref_opt, data[:4], accumulate=False)
    ids, _tgt = data[4]
    GatedSGD.gate.clear()
    lm_loss(model, *data[3]).backward()  # (one more step for each, gated on the host)
    opt.step()
    lm_loss(ref, *data[3]).backward()
    ref_opt.step()
    opener = threading.Timer(0.05, GatedSGD.gate.set)
    opener.start()
    try:
        with torch.no_grad():
            out = model(ids)
    finally:
        opener.join()
    with torch.no_grad():
        assert torch.equal(out, ref(ids))
    s = pager.of(model).stats()
    assert s.host_steps > 0 and s.host_step_wait_seconds > 0
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_another_thread_reads_a_weight_while_its_update_runs():
    """A read from another thread of a parameter whose block is being updated
    on the host sees the updated value (its fetch waits for the update)."""
    model, ref, opt, ref_opt = _gated_pair()
    data = batches(3)
    for i, (ids, tgt) in enumerate(data):
        if i == len(data) - 1:
            GatedSGD.gate.clear()  # the last step's updates on the host wait
        for m, o in ((model, opt), (ref, ref_opt)):
            lm_loss(m, ids, tgt).backward()
            o.step()
    running = [b for b in pager.of(model).blocks if b.host_update is not None and not b.host_update.done()]
    assert running
    seen = []
    reader = threading.Thread(target=lambda: seen.extend(float(p.detach().sum()) for p in model.parameters()))
    reader.start()
    try:
        time.sleep(0.05)
        assert reader.is_alive()  # (waiting for the updates)
    finally:
        GatedSGD.gate.set()
    reader.join(timeout=60)
    assert seen == [float(q.detach().sum()) for q in ref.parameters()]
    pager.unwrap(model)
    assert_models_equal(model, ref)


class FailingSGD(torch.optim.SGD):
    def step(self, closure=None):
        if self.param_groups[0]["params"] and self.state.get(self.param_groups[0]["params"][0], {}).get("fail"):
            raise FloatingPointError("injected")
        return super().step(closure)


def test_an_update_that_raises_on_the_host_is_reported_at_the_next_use():
    model = TinyLM()
    pager.wrap(model, budget=regime_budget(model, "streams", state_factor=1), device="cpu", optimizer_step="host")
    opt = FailingSGD(model.parameters(), lr=0.05, momentum=0.9)
    data = batches(3)
    train(model, opt, data[:2], accumulate=False)
    ids, tgt = data[2]
    lm_loss(model, ids, tgt).backward()
    block = next(b for b in pager.of(model).blocks
                 if "state" in b.segments and not any(seg.resident for seg in b.segments.values()))
    opt.state[block.params[0]]["fail"] = True
    opt.step()  # (returns: the update runs on the host)
    with pytest.raises(RuntimeError, match=f"update of block {block.name!r} on the host raised"):
        with torch.no_grad():
            model(ids)


def test_defer_step_false_finishes_host_updates_within_step():
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams", state_factor=1), device="cpu", defer_step=False,
               optimizer_step="host")
    opt, ref_opt = (SlowSGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref))
    for ids, tgt in batches(4):
        for m, o in ((model, opt), (ref, ref_opt)):
            lm_loss(m, ids, tgt).backward()
            o.step()
            o.zero_grad()
        assert not any(b.host_update is not None for b in pager.of(model).blocks)
    assert pager.of(model).stats().host_steps > 0
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_auto_leaves_optimizers_from_outside_torch_optim_on_the_device():
    """Their update may be slow on the host, or not per parameter: under
    "auto" they step on the device (deferred); "host" asks for the host."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams", state_factor=1), device="cpu")
    opt, ref_opt = (SlowSGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref))
    data = batches(4)
    train(model, opt, data)
    train(ref, ref_opt, data)
    s = pager.of(model).stats()
    assert s.host_steps == 0 and s.deferred_steps > 0
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_a_subclass_whose_step_calls_its_parents_hooked_step():
    """[Note: a step inside a step] in training/optim.py: with the parent
    class's step hooked (an instance of it exists), the inner call's hooks do
    nothing, and each parameter is updated once."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # (hooks SGD.step)
    for placement in ("host", "device"):
        model = TinyLM()
        ref = copy.deepcopy(model)
        pager.wrap(model, budget=regime_budget(model, "streams", state_factor=1), device="cpu",
                   optimizer_step=placement)
        opt, ref_opt = (SlowSGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref))
        data = batches(4)
        train(model, opt, data)
        train(ref, ref_opt, data)
        pager.unwrap(model)
        assert_models_equal(model, ref)
        _opt_states_equal(opt, ref_opt, model, ref)


def test_optimizer_step_is_checked():
    with pytest.raises(ValueError, match="optimizer_step='cpu'"):
        pager.wrap(TinyLM(), budget="1GiB", device="cpu", optimizer_step="cpu")


def auto_steps(forward, choosing=False):
    """`HostSteps` under "auto" as on CUDA, its forwards `forward[0]` seconds
    long (on CUDA they come from events), activations "auto" `choosing` or
    not; and a step: a forward, then the optimizer's step choosing."""
    from types import SimpleNamespace

    from pager.training.host_step import HostSteps

    fake = SimpleNamespace(transport=SimpleNamespace(is_cuda=True), optimizers=[],
                           activations=SimpleNamespace(choosing=choosing))
    steps = HostSteps(fake, "auto")
    steps.placement._read_forward = lambda: forward[0]

    def step(blocks):
        steps.forward_starts()
        return steps.choose(blocks)

    return steps, step


def test_auto_gives_the_device_one_block_more_while_forwards_wait_for_the_host():
    """[Note: how many update on the host]: the rule alone, with the forward's
    length and the waits given (on CUDA they come from events and fetches)."""
    from pager.training.host_placement import WAIT_SHARE

    steps, choose = auto_steps([0.1])  # a forward of 100 ms
    blocks = list(range(6))
    assert choose(blocks) == blocks  # nothing waited
    for expected in (5, 4, 3):
        steps.placement.waited_seconds += 2 * WAIT_SHARE * 0.1  # the last forward waited too long
        assert choose(blocks) == blocks[:expected]
        assert steps.choose(blocks) == blocks[:expected]  # (a second optimizer's step: the same forward)
    steps.placement.waited_seconds += WAIT_SHARE * 0.1 / 2  # a little: as many as before
    assert choose(blocks) == blocks[:3]
    assert choose(blocks) == blocks[:4]  # no wait: one block back to the host
    steps.mode = "host"
    assert steps.choose(blocks) == blocks


def test_auto_takes_back_a_block_whose_update_on_the_device_made_the_forward_longer():
    """[Note: how many update on the host]: a block given to the device is on
    trial for one forward; if that forward is longer than the one before, it
    goes back to the host and no more go to the device for `HOLD_STEPS`
    steps, however the forwards wait."""
    from pager.training.host_placement import HOLD_STEPS, SLOWER_SHARE, WAIT_SHARE

    forward = [0.1]
    steps, choose = auto_steps(forward)
    blocks = list(range(6))

    def waited_too_long():
        steps.placement.waited_seconds += 2 * WAIT_SHARE * forward[0]

    waited_too_long()
    assert choose(blocks) == blocks[:5]  # one on trial
    waited_too_long()
    assert choose(blocks) == blocks[:4]  # the forward did not grow: kept, and one more on trial
    forward[0] *= 1 + 2 * SLOWER_SHARE
    waited_too_long()
    assert choose(blocks) == blocks[:5]  # it grew: that one goes back
    for _ in range(HOLD_STEPS - 1):
        waited_too_long()
        assert choose(blocks) == blocks[:5]  # held there, though the forwards wait
    waited_too_long()
    assert choose(blocks) == blocks[:4]  # tried again
    assert choose(blocks[:1]) == []  # (fewer blocks than on the device: all of them there)


def test_the_workers_thread_ends_when_idle_and_comes_back(monkeypatch):
    import pager.training.host_step as host_step

    monkeypatch.setattr(host_step, "IDLE_SECONDS", 0.05)
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu", optimizer_step="host")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    data = batches(6)

    worker = pager.of(model).host_steps

    train(model, opt, data[:3])
    thread = worker._worker._thread
    assert thread is not None and thread.is_alive()
    pager.of(model).apply_deferred()  # (the updates in flight done)
    thread.join(timeout=10)
    assert not thread.is_alive() and worker._worker._thread is None
    train(model, opt, data[3:])
    assert worker.pager.stats().host_steps > 0
    train(ref, ref_opt, data[:3])
    train(ref, ref_opt, data[3:])
    pager.unwrap(model)
    assert worker._worker is None
    assert_models_equal(model, ref)


def test_a_process_that_ends_with_the_host_worker_alive_exits_cleanly():
    """The worker thread is still alive (idle, or finishing the last step's
    updates) when a training script ends: the interpreter must exit cleanly,
    not abort (a spawned rank would die of SIGABRT)."""
    script = textwrap.dedent("""
        import torch
        import pager
        from models import TinyLM
        from test_training import batches, lm_loss, regime_budget
        model = TinyLM()
        pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu", optimizer_step="host")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for ids, tgt in batches(4):
            lm_loss(model, ids, tgt).backward()
            opt.step()
            opt.zero_grad()
        assert pager.of(model).stats().host_steps > 0
    """)
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    for _ in range(3):  # (it aborted in most runs)
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-2000:]


def test_a_rank_of_several_updates_on_its_share_of_the_cores(monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 for each of several ranks; the host
    worker takes the rank's share of the cores instead, never fewer than
    torch's setting, and leaves torch's setting alone for one process."""
    from pager.training import host_step

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert host_step.host_threads() == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_step.host_threads() == 8
    monkeypatch.setattr(torch, "get_num_threads", lambda: 12)
    assert host_step.host_threads() == 12


def test_the_host_worker_runs_on_the_threads_it_was_given():
    from pager.training.host_jobs import AfterCopy
    from pager.training.host_step import HostWorker

    before = torch.get_num_threads()
    seen = []
    worker = HostWorker(threads=3)
    try:
        worker.submit(AfterCopy(None, lambda: seen.append(torch.get_num_threads()))).result(timeout=10)
        worker.close()
        assert seen == [3]
        assert torch.get_num_threads() == before  # (this thread keeps its own setting)
    finally:
        torch.set_num_threads(before)  # (threads started later take the last setting)


def test_one_factor_takes_a_single_clip_on_every_stepped_gradient_only():
    """[Note: a clip in the fused update]: the fused kernel takes the factor
    only where one scaling, the same on every gradient the update steps, is
    all that was recorded; anything else is replayed first."""
    from pager.training.host_jobs import grad_scale, one_factor

    c = torch.tensor(0.25)
    assert one_factor({0: [("mul", c)], 1: [("mul", c)]}, {0, 1}) is c
    assert one_factor({0: [("mul", 0.5)]}, {0}) == 0.5
    assert one_factor({0: [("mul", c)]}, {0, 1}) is None  # one gradient not scaled
    assert one_factor({0: [("mul", c)], 2: [("mul", c)]}, {0}) is None  # a scaled one the update does not step
    assert one_factor({0: [("mul", c)], 1: [("mul", torch.tensor(0.25))]}, {0, 1}) is None  # two factors
    assert one_factor({0: [("zero", None), ("mul", c)]}, {0}) is None
    assert one_factor({0: [("mul", c), ("mul", c)]}, {0}) is None
    assert one_factor({0: [("mul", torch.ones(2))]}, {0}) is None
    assert one_factor({0: [("mul", 0)]}, {0}) is None
    assert one_factor({}, set()) is None
    assert grad_scale(c).item() == 4.0 and grad_scale(c).dtype == torch.float32 and grad_scale(0.5).item() == 2.0


def test_under_a_clip_the_host_takes_the_blocks_it_finishes_in_time():
    """[Note: a clip holds the host's updates back]: in forward order, a
    block updates on the host when the host, starting at the step, finishes
    it a block's time before the forward reaches it; the others (the first
    ones) update on the device."""
    from types import SimpleNamespace

    from pager.training.host_placement import Placement

    def block(i, nbytes=100):
        return SimpleNamespace(index=i, segments={"weights": SimpleNamespace(nbytes=nbytes)})

    blocks = [block(i) for i in range(8)]
    steps = Placement(SimpleNamespace(blocks=blocks))
    steps.seconds_per_byte = 0.015 / 100  # 15 ms a block on the host; the forward 10.625 ms a block
    host = steps._by_deadline(blocks, forward=0.085)
    # The host's k-th block is done at 15k ms, needed by (index - 1) * 10.625 ms.
    assert [b.index for b in host] == [3, 4, 6, 7]
    steps.seconds_per_byte = 0.001 / 100  # a fast host takes all but the first two
    assert [b.index for b in steps._by_deadline(blocks, forward=0.080)] == [2, 3, 4, 5, 6, 7]


def _steps_of(n):
    from types import SimpleNamespace

    from pager.training.host_placement import Placement

    blocks = [SimpleNamespace(index=i, segments={"weights": SimpleNamespace(nbytes=100)}) for i in range(n)]
    return Placement(SimpleNamespace(blocks=blocks)), blocks


def test_under_a_clip_a_late_block_goes_to_the_host_where_its_wait_costs_less_than_the_device():
    """The schedule weighs what an update given to the device adds to the
    forward (`device_update_seconds`): a block the host finishes late
    updates there where its wait is shorter, and every later block is
    reached later by what the forward waited or carried so far."""
    steps, blocks = _steps_of(8)
    steps.seconds_per_byte = 0.015 / 100  # 15 ms a block on the host; the forward 10.625 ms a block
    steps.device_update_seconds = 0.010
    # Block 0 would wait 25.6 ms: to the device (10 ms). From then on each waits 4.4 ms: the host.
    assert [b.index for b in steps._by_deadline(blocks, forward=0.085)] == [1, 2, 3, 4, 5, 6, 7]
    steps.device_update_seconds = 0.003
    # Blocks 0 and 1 (25.6, 12 ms late) and 4 (4.4 ms) cost more on the host than 3 ms on the device.
    assert [b.index for b in steps._by_deadline(blocks, forward=0.085)] == [2, 3, 5, 6, 7]


def test_the_forwards_own_length_is_taken_only_where_nothing_else_is_in_it():
    """[Note: a clip holds the host's updates back]: a forward that waited
    for the host can only raise the forward's own length, one that carried
    updates given to the device only lower it (and measure what one adds);
    the choices that follow them stay put (they took turns before: all to
    the host, then ten to the device, then all to the host)."""
    steps, blocks = _steps_of(18)
    steps.seconds_per_byte = 0.050 / 100
    steps._measure_pace(0.228, 0.0)  # nothing in it
    assert steps._forward_seconds == 0.228
    first = [b.index for b in steps._by_deadline(blocks, steps._forward_seconds)]
    steps._gave_device = 0
    steps._measure_pace(0.301, 0.160)  # every block to the host: it waited (0.141 s without the waits)
    assert steps._forward_seconds == 0.228
    steps._gave_device = 10
    steps._measure_pace(0.409, 0.0)  # it carried ten updates given to the device
    assert steps._forward_seconds == 0.228 and steps.device_update_seconds == pytest.approx(0.0181)
    steps._measure_pace(0.5, 0.1)  # both: says nothing
    assert steps._forward_seconds == 0.228 and steps.device_update_seconds == pytest.approx(0.0181)
    steps.device_update_seconds = None
    assert [b.index for b in steps._by_deadline(blocks, steps._forward_seconds)] == first
    steps._gave_device = 0
    steps._measure_pace(0.4, 0.0)  # a longer forward with nothing in it (a longer batch): taken
    assert steps._forward_seconds == 0.4
    steps._gave_device = 3
    steps._measure_pace(0.3, 0.0)  # carried updates, and shorter still: at most this
    assert steps._forward_seconds == 0.3 and steps.device_update_seconds == 0.0


def test_a_cold_first_forward_does_not_bound_the_forwards_own_length():
    """The first forward measured may be slow (kernels chosen, memory
    pinned): forwards that waited for the host then bound its own length
    from below only, but no forward's own length exceeds the whole of it."""
    steps, _blocks = _steps_of(18)
    steps._measure_pace(2.0, 0.0)
    for _ in range(3):
        steps._gave_device = 1
        steps._measure_pace(0.45, 0.15)  # carried one update given to the device, and waited
        assert steps._forward_seconds == 0.45
    steps._gave_device = 0
    steps._measure_pace(0.40, 0.15)  # waited only: at least 0.25, at most 0.40
    assert steps._forward_seconds == 0.40
