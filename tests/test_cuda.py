"""The paging path on a real GPU: parity with all-on-GPU, the budget from the
allocator's own peak, and races made wide with injected sleeps."""

import copy
import functools
import os

import pytest
import torch
import torch.nn as nn

import pager
from helpers import hooked_blocks, reading_in_a_thread, run_threads, streamed_llama, tensor_page_bytes
from models import SuperNet, Thin, TinyLM, tiny_cnn
from test_training import OPTIMIZERS, batches, lm_loss, regime_budget, train, train_supernet

pytestmark = pytest.mark.cuda

GPU = torch.device("cuda")


def _sleepy(transport, h2d_cycles=2_000_000, compute_cycles=0, d2h_cycles=0):
    """Delay every copy on the h2d stream (and optionally every write-back on
    the d2h stream, and compute before each release): a missing wait then
    reads bytes not yet landed, or overwrites bytes still being read (an
    update on the host that did not wait for its gradients' write-back would
    read the old page)."""
    for name, stream, cycles in (("h2d", transport.h2d_stream, h2d_cycles), ("d2h", transport.d2h_stream, d2h_cycles)):
        if cycles:
            setattr(transport, name, _delayed(getattr(transport, name), stream, cycles))
    if compute_cycles:
        sleep_before_marks(transport, compute_cycles)


def sleep_before_marks(transport, cycles):
    """Compute sleeps before each mark of it (a release's, a wait's, an eviction's fresh one)."""
    for name in ("record_compute", "mark_compute"):
        setattr(transport, name, _after_sleep(getattr(transport, name), cycles))


def _after_sleep(mark, cycles):
    def slow_mark():
        torch.cuda._sleep(cycles)
        return mark()

    return slow_mark


def _delayed(copy, stream, cycles):
    def slow_copy(dst, src, after=(), **kw):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
        return copy(dst, src, after, **kw)

    return slow_copy


@pytest.mark.parametrize("factory,inputs", [
    (TinyLM, lambda: torch.randint(0, 64, (2, 16), device=GPU)),
    (tiny_cnn, lambda: torch.randn(4, 3, 16, 16, device=GPU)),
    (Thin, lambda: torch.randn(8, 1024, device=GPU)),
])
def test_forward_parity_with_all_on_gpu(factory, inputs):
    model = factory().eval()
    ref = copy.deepcopy(model).to(GPU)
    pager.wrap(model, budget=_two_blocks(model), device=GPU)
    for _ in range(5):
        x = inputs()
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x))
    assert pager.of(model).stats().peak_resident_bytes <= pager.of(model).budget_bytes


def assert_close_to_reference(model, ref, rtol=1e-4, atol=1e-5):
    for (n, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(a.to(GPU), b, rtol=rtol, atol=atol, msg=n)


def kernel_spread(model, make, run) -> float:
    """How far torch's own AdamW kernels on the GPU land apart on this run:
    the largest difference between `model` (a copy of the starting one)
    trained by `run(model, opt)` with the fused and with the foreach kernel.
    Updates on the host run torch's fused CPU kernel ([Note: the optimizer
    step on the host]): they must land within this spread (Adam's update
    is about `lr` wherever a gradient is near zero, whichever way rounding
    turns it)."""
    states = []
    for fused in (True, False):
        m = copy.deepcopy(model).to(GPU)
        run(m, make(m.parameters(), fused=fused, foreach=not fused))
        states.append(m.state_dict())
    return max((a - b).abs().max().item() for a, b in zip(states[0].values(), states[1].values()))


def assert_within(model, ref, spread):
    """Within `spread` (torch's own kernels' spread, at least the usual 1e-5) of `ref`."""
    atol = max(spread, 1e-5)
    for (n, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert (a.to(GPU) - b).abs().max().item() <= atol, (n, (a.to(GPU) - b).abs().max().item(), atol)


def _two_blocks(model):
    probe = copy.deepcopy(model)
    pager.wrap(probe, budget="100%", device="cpu")
    pg = pager.of(probe)
    budget = pg.min_budget_bytes + max(b.nbytes() for b in pg.blocks)
    pager.unwrap(probe)
    return budget


def test_budget_bound_from_the_allocator():
    """Peak allocated during a paged forward <= budget + the activations the
    same forward needs all-on-GPU (worked out by running it) + slack for
    the allocator's 512-byte rounding."""
    model = Thin().eval()
    x = torch.randn(8, 1024, device=GPU)
    ref = copy.deepcopy(model).to(GPU)
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        ref(x)
    activations = torch.cuda.max_memory_allocated() - weights
    del ref
    torch.cuda.empty_cache()
    budget = 3 * tensor_page_bytes(model.layers[0])
    pager.wrap(model, budget=budget, device=GPU)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for _ in range(5):
            model(x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= budget + activations + 64 * 1024, (peak, budget, activations)
    assert pager.of(model).stats().evictions > 0


@pytest.mark.parametrize("compute_sleep", [0, 5_000_000])
def test_races_with_delayed_copies(compute_sleep):
    model = Thin().eval()
    ref = copy.deepcopy(model).to(GPU)
    budget = 2 * tensor_page_bytes(model.layers[0])
    pager.wrap(model, budget=budget, device=GPU, budget_covers="pager")
    _sleepy(pager.of(model).transport, compute_cycles=compute_sleep)
    for _ in range(6):
        x = torch.randn(8, 1024, device=GPU)
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x))
    s = pager.of(model).stats()
    assert s.evictions > 0 and s.prefetches > 0


@pytest.mark.parametrize("fused", [False, True])
def test_the_first_updates_hold_the_budget_with_their_new_state_and_temporaries_on_gpu(fused):
    """[Note: the step's room]: layers of 64 MiB trained with AdamW under a
    process budget that holds about three of them with their gradients and
    state: from the first step on, the allocator's peak in `opt.step()`, with
    the state each first update creates, its copy into the page and the
    foreach kernels' temporaries, stays within the budget (before, the first
    went over by about two layers' state); the weights are the bare model's."""
    torch.manual_seed(0)
    width, n = 4096, 8
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])
    xs = [torch.randn(8, width, device=GPU) for _ in range(4)]
    peaks = {"step": 0}

    def train_steps(m, opt):
        for x in xs:
            m(x).square().mean().backward()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()  # (the update's own peak, from here)
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            peaks["step"] = max(peaks["step"], torch.cuda.max_memory_allocated())

    ref = copy.deepcopy(model).to(GPU)
    train_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=fused))
    want = [w.detach().cpu() for w in ref.parameters()]
    del ref
    torch.cuda.empty_cache()
    caller = torch.cuda.memory_allocated()  # (the inputs and what earlier tests left)
    budget = caller + 13 * tensor_page_bytes(model[0])
    pager.wrap(model, budget=budget, device=GPU, optimizer_step="device")  # (it resets the peak counter)
    peaks["step"] = 0
    train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused))
    assert peaks["step"] <= budget, (peaks, budget)  # (the passes: test_the_budget_covers_the_loss_on_gpu)
    assert pager.of(model).stats().evictions > 0
    for got, w in zip(model.parameters(), want):
        torch.testing.assert_close(got.detach().cpu(), w, rtol=1e-5, atol=1e-6)
    pager.unwrap(model)


def test_the_default_budget_covers_what_the_caller_holds_from_the_first_forward_on_gpu():
    """The budget covers the process by default ([Note: a budget that covers
    the process]): what the caller holds on the GPU when a forward starts (a
    tensor of its own, the inputs) is seen before any block is fetched, so
    blocks leave it room from the first forward on, and the allocator's peak
    stays within the budget but for a block's temporaries; the outputs are
    the bare model's."""
    model = Thin().eval()
    ref = copy.deepcopy(model).to(GPU)
    xs = [torch.randn(8, 1024, device=GPU) for _ in range(4)]
    with torch.no_grad():
        want = [ref(x) for x in xs]
    del ref
    layer = tensor_page_bytes(model.layers[0])
    held = torch.empty(3 * layer, dtype=torch.uint8, device=GPU)  # the caller's, beside the model
    torch.cuda.synchronize()
    caller = torch.cuda.memory_allocated()  # (with the inputs, the outputs wanted and what earlier tests left)
    budget = caller + 4 * layer
    pager.wrap(model, budget=budget, device=GPU)  # (it resets the peak counter)
    p = pager.of(model)
    with torch.no_grad():
        for x, w in zip(xs, want):
            torch.testing.assert_close(model(x), w)
    torch.cuda.synchronize()
    s = p.stats()
    assert s.outside_bytes >= caller and s.evictions > 0, s
    # (the caller then holds a forward's output too, seen at its end)
    assert s.peak_resident_bytes + s.outside_bytes <= budget + xs[0].nbytes, s
    temporaries = 6 * xs[0].nbytes  # (a block's while it runs: its input, output and tanh's, the last output)
    assert torch.cuda.max_memory_allocated() <= budget + temporaries, (torch.cuda.max_memory_allocated(), budget)
    del held
    pager.unwrap(model)


def test_writeback_race_with_batchnorm():
    """Dirty blocks written back on the d2h stream while the next fetch
    reuses their memory: the host pages must hold the new running stats."""
    model = tiny_cnn()
    ref = copy.deepcopy(model).to(GPU)
    budget = _two_blocks(model)
    pager.wrap(model, budget=budget, device=GPU)
    _sleepy(pager.of(model).transport, compute_cycles=3_000_000)
    for _ in range(5):
        x = torch.randn(4, 3, 16, 16, device=GPU)
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x))
    assert pager.of(model).stats().d2h_bytes > 0
    pager.unwrap(model)
    assert_close_to_reference(model, ref, rtol=None, atol=None)


@pytest.mark.parametrize("opt_name", ["adamw", "sgd_momentum", "adamw_foreach"])
@pytest.mark.parametrize("regime,placement", [("fits", "auto"), ("streams", "device"), ("streams", "host")])
def test_training_parity_on_gpu(opt_name, regime, placement):
    model = TinyLM()
    start = copy.deepcopy(model)
    ref = copy.deepcopy(model).to(GPU)
    budget = regime_budget(model, regime, {"sgd_momentum": 1}.get(opt_name, 2))
    make = OPTIMIZERS[opt_name]
    # (the budget is the process's where it fits, the default: the model trains asleep beside its reference,
    # [Note: asleep]; where it streams, a few blocks' worth, pager's alone, which the reference would crowd)
    pager.wrap(model, budget=budget, device=GPU, optimizer_step=placement,
               **({} if regime == "fits" else {"budget_covers": "pager"}))
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    data = [(a.to(GPU), b.to(GPU)) for a, b in batches(8)]
    train(model, opt, data)
    train(ref, ref_opt, data)
    s = pager.of(model).stats()
    assert s.peak_resident_bytes <= budget
    assert (s.resident_forwards > 0) == (regime == "fits")  # trained asleep ([Note: asleep])
    assert (s.host_steps > 0) == (placement == "host")
    pager.unwrap(model)
    if placement == "host" and opt_name != "sgd_momentum":
        assert_within(model, ref, kernel_spread(start, make, lambda m, o: train(m, o, data)))
    else:
        assert_close_to_reference(model, ref)


def test_a_graph_built_asleep_lets_the_blocks_go_once_its_backward_ends_on_gpu():
    """The backward runs on autograd's device thread: its end there lets the
    blocks go, so the budget can drop between steps and training goes on paged."""
    model = TinyLM()
    ref = copy.deepcopy(model).to(GPU)
    pager.wrap(model, budget=1 << 30, device=GPU, optimizer_step="device", budget_covers="pager")  # (the host's: tested above)
    pg = pager.of(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    for i, (ids, tgt) in enumerate(batches(6)):
        for m, o in ((model, opt), (ref, ref_opt)):
            lm_loss(m, ids.to(GPU), tgt.to(GPU)).backward()
            o.step()
            o.zero_grad()
        if i == 2:
            assert hooked_blocks(model) == 0
            pg.set_budget(regime_budget(model, "streams"))
    assert pg.stats().evictions > 0
    pager.unwrap(model)
    assert_close_to_reference(model, ref)


class SlowAdam(torch.optim.Adam):
    """Adam whose every update takes a while more: on the host, the next
    forward's fetches must wait for it."""

    def step(self, closure=None):
        import time

        time.sleep(0.01)
        return super().step(closure)


@pytest.mark.parametrize("defer_step,placement,make", [
    (True, "device", torch.optim.Adam), (False, "device", torch.optim.Adam), (True, "host", torch.optim.Adam),
    (True, "auto", torch.optim.Adam), (False, "host", torch.optim.Adam), (True, "host", SlowAdam)])
def test_training_races_and_peak_memory(defer_step, placement, make):
    model = TinyLM(d=256, n_layers=6)
    start = copy.deepcopy(model)
    ref = copy.deepcopy(model).to(GPU)
    budget = regime_budget(model, "streams")
    pager.wrap(model, budget=budget, device=GPU, defer_step=defer_step, optimizer_step=placement, budget_covers="pager")
    _sleepy(pager.of(model).transport, h2d_cycles=1_000_000, compute_cycles=1_000_000, d2h_cycles=2_000_000)
    opt, ref_opt = make(model.parameters(), lr=1e-3), make(ref.parameters(), lr=1e-3)
    data = [(a.to(GPU), b.to(GPU)) for a, b in batches(6)]
    # cuBLAS takes a workspace per thread at its first matmul (the autograd
    # engine's thread too): not pager's memory, so taken before measuring.
    w = torch.randn(8, 8, device=GPU, requires_grad=True)
    (w @ w).sum().backward()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    train(model, opt, data, accumulate=False)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    s = pager.of(model).stats()
    if placement == "device":
        assert (s.deferred_steps > 0) == defer_step and s.host_steps == 0
    else:
        assert s.host_steps > 0
    train(ref, ref_opt, data, accumulate=False)
    # Activations of this small model are far below one block; the first
    # step briefly holds one block's new optimizer state twice (before adoption).
    assert peak <= budget + 2 * 2 * tensor_page_bytes(model.layers[0]), (peak, budget)
    pager.unwrap(model)
    if placement == "device":
        assert_close_to_reference(model, ref)
    else:
        assert_within(model, ref, kernel_spread(start, torch.optim.Adam,
                                                lambda m, o: train(m, o, data, accumulate=False)))


def test_updates_on_the_host_with_clipping_and_a_schedule_on_gpu(monkeypatch):
    """torch's fused CPU AdamW on the host against the foreach CUDA one: the
    same within rounding, with a clip whose factor is a device tensor, which
    the fused kernel takes in its one pass ([Note: a clip in the fused
    update]): no update replays it first."""
    from pager.training import host_jobs

    folded, replayed = [], []
    run_job = host_jobs.HostJob.run

    def spy(job):
        (folded if job.grad_factor is not None else replayed).append(bool(job.scales))
        return run_job(job)

    monkeypatch.setattr(host_jobs.HostJob, "run", spy)
    model = TinyLM(d=128, n_layers=6)
    start = copy.deepcopy(model)
    ref = copy.deepcopy(model).to(GPU)
    pager.wrap(model, budget=regime_budget(model, "streams"), device=GPU, optimizer_step="host", budget_covers="pager")
    _sleepy(pager.of(model).transport, h2d_cycles=0, d2h_cycles=2_000_000)
    make = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    data = [(a.to(GPU), b.to(GPU)) for a, b in batches(6)]

    def run(m, o):
        sched = torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
        train(m, o, data, clip=lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5), sched=sched)

    run(model, make(model.parameters()))
    run(ref, make(ref.parameters()))
    assert pager.of(model).stats().host_steps > 0
    assert folded and not any(replayed)  # (jobs took the clip's factor; none replayed a scaling first)
    pager.unwrap(model)
    assert_within(model, ref, kernel_spread(start, make, run))


def test_bf16_autocast_and_grad_scaler_on_gpu():
    model = TinyLM()
    ref = copy.deepcopy(model).to(GPU)
    pager.wrap(model, budget=1 << 30, device=GPU)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    scaler, ref_scaler = torch.amp.GradScaler("cuda"), torch.amp.GradScaler("cuda")
    for ids, tgt in batches(5):
        ids, tgt = ids.to(GPU), tgt.to(GPU)
        for m, o, s in ((model, opt, scaler), (ref, ref_opt, ref_scaler)):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = lm_loss(m, ids, tgt)
            s.scale(loss).backward()
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            s.step(o)
            s.update()
            o.zero_grad()
    pager.unwrap(model)
    assert_close_to_reference(model, ref, rtol=1e-3, atol=1e-4)


def test_supernet_on_gpu():
    net = SuperNet(d=128, n_layers=4)
    ref = copy.deepcopy(net).to(GPU)
    budget = regime_budget(net, "streams")
    pager.wrap(net, budget=budget, device=GPU, optimizer_step="device", budget_covers="pager")  # (on the host: test_host_step, bit for bit)
    opt, ref_opt = torch.optim.Adam(net.parameters(), lr=1e-3), torch.optim.Adam(ref.parameters(), lr=1e-3)
    data = [(a.to(GPU), b.to(GPU)) for a, b in batches(8)]
    train_supernet(net, ref, opt, ref_opt, data, torch.Generator().manual_seed(0), n_candidates=4)
    assert pager.of(net).stats().peak_resident_bytes <= budget
    pager.unwrap(net)
    assert_close_to_reference(net, ref)


def test_model_already_on_gpu_is_paged_from_there():
    model = TinyLM().to(GPU)
    ref = copy.deepcopy(model)
    before = torch.cuda.memory_allocated()
    pager.wrap(model, budget=_two_blocks(copy.deepcopy(model).cpu()), device=GPU)
    assert torch.cuda.memory_allocated() < before
    ids = torch.randint(0, 64, (2, 8), device=GPU)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids))
    pager.unwrap(model)
    assert model.layers[0].attn.qkv.weight.device.type == "cuda"


def test_pinned_pages_are_page_locked():
    model = Thin(n=2)
    pager.wrap(model, budget=1 << 30, device=GPU)
    pg = pager.of(model)
    assert all(b.weights.host.is_pinned() for b in pg.blocks)


# ------------------------------------------------------------- bad input on a GPU
def test_budget_larger_than_the_device():
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(ValueError, match="larger than cuda:0's"):
        pager.wrap(TinyLM(), budget=2 * total, device=GPU)


def test_a_device_index_that_does_not_exist():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"has {n} CUDA device"):
        pager.wrap(TinyLM(), budget="1GiB", device=f"cuda:{n}")


def test_parameters_on_several_devices():
    model = TinyLM()
    model.layers[0].to(GPU)
    with pytest.raises(ValueError, match="several devices.*model.cpu"):
        pager.wrap(model, budget="1GiB", device=GPU)


def test_pinning_refused_explains_memlock_and_the_fix(monkeypatch):
    from pager.engine import host as _host
    class Refusing:
        @staticmethod
        def cudaHostRegister(ptr, size, flags):
            return 2  # cudaErrorMemoryAllocation

        @staticmethod
        def cudaHostUnregister(ptr):
            return 0

    monkeypatch.setattr(_host.torch.cuda, "cudart", lambda: Refusing)
    model = TinyLM()
    with pytest.raises(MemoryError, match=r"ulimit -l.*pin=False"):
        pager.wrap(model, budget="1GiB", device=GPU)


def test_pageable_host_pages_work():
    model = TinyLM().eval()
    ref = copy.deepcopy(model).to(GPU)
    pager.wrap(model, budget=_two_blocks(model), device=GPU, pin=False)
    assert not pager.of(model).blocks[0].weights.host.is_pinned()
    ids = torch.randint(0, 64, (2, 8), device=GPU)
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(model(ids), ref(ids))


def test_state_dict_is_on_the_host_and_needs_no_device_room():
    model = TinyLM()
    pager.wrap(model, budget=_two_blocks(model), device=GPU)
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 8), device=GPU))
    before = torch.cuda.memory_allocated()
    sd = model.state_dict()
    assert torch.cuda.memory_allocated() == before
    assert all(v.device.type == "cpu" for v in sd.values())
    fresh = TinyLM()
    fresh.load_state_dict(sd)
    pager.unwrap(model)
    for (n, a), (_, b) in zip(fresh.state_dict().items(), model.state_dict().items()):
        torch.testing.assert_close(a, b.cpu(), rtol=0, atol=0, msg=n)


def _page_out_everything(model):
    p = pager.of(model)
    with p.lock:
        for block in list(p.resident):
            if block.pins == 0 and not block.resident_for_life:
                p.engine.evict(block)


def test_reads_and_writes_of_paged_out_tensors_on_gpu():
    """Reads, in-place writes, views and gradients of paged-out blocks, with
    copies delayed on the h2d stream: a missing wait would read freed or
    not-yet-landed memory (the sanitizer watches these too)."""
    model = TinyLM(d=64)
    ref = copy.deepcopy(model).to(GPU)
    pager.wrap(model, budget=regime_budget(model, "streams"), device=GPU, budget_covers="pager")
    _sleepy(pager.of(model).transport)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    data = [(i.to(GPU), t.to(GPU)) for i, t in batches(4)]
    for ids, tgt in data:
        for m, o in ((model, opt), (ref, ref_opt)):
            lm_loss(m, ids, tgt).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
            o.zero_grad()
    _page_out_everything(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.norm(), q.norm(), rtol=1e-4, atol=1e-5)
    _page_out_everything(model)
    kept = model.layers[2].mlp[0].weight.data  # a view kept across evictions
    with torch.no_grad():
        for m in (model, ref):
            m.layers[1].mlp[0].weight.mul_(0.5)
            m.layers[3].attn.qkv.weight.data.add_(0.01)
    ids, tgt = data[0]
    for m in (model, ref):
        lm_loss(m, ids, tgt).backward()
    _page_out_everything(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.clone(), q.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kept.sum(), ref.layers[2].mlp[0].weight.sum(), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize()


def test_fp16_grad_scaler_and_torch_clip_where_the_step_does_not_fit():
    model = TinyLM(d=64)
    ref = copy.deepcopy(model).to(GPU)
    pager.wrap(model, budget=regime_budget(model, "streams"), device=GPU, optimizer_step="device", budget_covers="pager")
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    scalers = [torch.amp.GradScaler("cuda", growth_interval=3) for _ in range(2)]
    on_demand = []
    for step, (ids, tgt) in enumerate(batches(8)):
        ids, tgt = ids.to(GPU), tgt.to(GPU)
        for m, o, s in ((model, opt, scalers[0]), (ref, ref_opt, scalers[1])):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = lm_loss(m, ids, tgt)
            if step == 4:
                loss = loss * float("inf")  # skipped by both
            s.scale(loss).backward()
            before = pager.of(model).stats().on_demand
            s.unscale_(o)
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            if m is model:
                on_demand.append(pager.of(model).stats().on_demand - before)
                model_norm = norm
            elif step != 4:
                torch.testing.assert_close(model_norm, norm, rtol=1e-3, atol=1e-4)
            s.step(o)
            s.update()
            o.zero_grad()
        assert scalers[0].get_scale() == scalers[1].get_scale()
    assert pager.of(model).stats().evictions > 0
    assert on_demand[2:] == [0] * (len(on_demand) - 2), on_demand  # from the norms taken as gradients left
    pager.unwrap(model)
    assert_close_to_reference(model, ref, rtol=1e-3, atol=1e-4)



def test_views_kept_from_a_forward_on_gpu():
    """A forward keeps views of its weights (an attribute, an output slice read
    after its block left); with copies delayed, none reads freed or reused
    memory (the sanitizer watches too)."""
    from test_kept_views import Chain

    torch.manual_seed(0)
    model = Chain()
    ref = copy.deepcopy(model).to(GPU)
    one = sum(t.numel() * t.element_size() for t in model.layers[0].state_dict().values())
    pager.wrap(model, budget=2 * one + 4096, device=GPU, budget_covers="pager")
    _sleepy(pager.of(model).transport)
    x = torch.randn(4, 32, device=GPU)
    for grad in (False, True, True):
        with torch.set_grad_enabled(grad):
            out, slices = model(x)
            ref_out, ref_slices = ref(x)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        if grad:
            out.sum().backward()
            ref_out.sum().backward()
    _page_out_everything(model)
    for layer, ref_layer, s, r in zip(model.layers, ref.layers, slices, ref_slices):
        torch.testing.assert_close(layer.cache, ref_layer.cache, rtol=0, atol=0)
        torch.testing.assert_close(s, r, rtol=0, atol=0)
        torch.testing.assert_close(layer.lin.weight.grad.clone(), ref_layer.lin.weight.grad, rtol=1e-5, atol=1e-5)
    torch.cuda.synchronize()


def test_another_thread_reads_while_the_model_trains_on_gpu():
    """The shared mode on a GPU, copies delayed: a reader thread's accesses are
    served (pinned) while the training thread's uses pass the guard."""
    model = TinyLM(d=64)
    ref = copy.deepcopy(model).to(GPU)
    pager.wrap(model, budget=regime_budget(model, "streams"), device=GPU, optimizer_step="device", budget_covers="pager")
    _sleepy(pager.of(model).transport)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    def check(t):
        if not torch.isfinite(t.detach().float().sum()):
            raise AssertionError("non-finite read")

    with reading_in_a_thread(list(model.parameters()), check) as log:
        for ids, tgt in batches(4):
            ids, tgt = ids.to(GPU), tgt.to(GPU)
            for m, o in ((model, opt), (ref, ref_opt)):
                lm_loss(m, ids, tgt).backward()
                o.step()
                o.zero_grad()
    errors = log["errors"]
    assert not errors, errors
    assert pager.of(model).shared_mode
    pager.unwrap(model)
    assert_close_to_reference(model, ref, rtol=1e-4, atol=1e-5)


def test_activations_offloaded_on_gpu_parity_races_and_peak():
    """Saved activations leave for the host as the forward goes on and come
    back for the backward: the same gradients as all on the GPU, with copies
    delayed on both streams (a missing wait reads bytes not yet landed), and
    an allocator peak that no longer grows with the depth."""
    d, n, rows = 1024, 48, 4096
    act = rows * d * 4  # one activation, fp32
    peaks, budgets = {}, {}
    for activations in ("keep", "offload"):
        torch.manual_seed(0)
        model = Thin(d=d, n=n)
        ref = copy.deepcopy(model).to(GPU)
        budget = regime_budget(model, "streams")
        if activations == "offload":  # the budget bounds activations too: room for what offloading holds
            budget += activation_room(model, torch.zeros(rows, d), "offload")
        budgets[activations] = budget
        pager.wrap(model, budget=budget, device=GPU, activations=activations, budget_covers="pager")
        p = pager.of(model)
        if activations == "offload":
            send, bring = p.transport.send_to_host, p.transport.bring_to_device

            def slow_send(t):
                with torch.cuda.stream(p.transport.d2h_stream):
                    torch.cuda._sleep(1_000_000)
                return send(t)

            def slow_bring(host, written=None):
                with torch.cuda.stream(p.transport.h2d_stream):
                    torch.cuda._sleep(1_000_000)
                return bring(host, written)

            p.transport.send_to_host, p.transport.bring_to_device = slow_send, slow_bring
        opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.Adam(ref.parameters(), lr=1e-3)
        w = torch.randn(8, 8, device=GPU, requires_grad=True)
        (w @ w).sum().backward()  # cuBLAS workspaces, before measuring
        peak = 0
        for step in range(3):
            x = torch.randn(rows, d, device=GPU)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            if step:  # optimizer state exists from the second step on
                peak = max(peak, torch.cuda.max_memory_allocated() - base)
            ref(x).pow(2).mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
        peaks[activations] = peak
        s = p.stats()
        assert (s.activations_sent_bytes > 0) == (activations == "offload")
        pager.unwrap(model)
        assert_close_to_reference(model, ref)
        del model, ref, opt, ref_opt, x
        torch.cuda.empty_cache()
    # Kept: every layer's input stays until the backward.
    assert peaks["keep"] >= n * act, (peaks, budgets, act)
    # Offloaded: a few at a time (the one being written, the ones being copied
    # out; in the backward two blocks' worth brought back), within the budget
    # that bounds them with the blocks, beside the gradients between blocks.
    assert peaks["offload"] <= budgets["offload"] + 4 * act < peaks["keep"], (peaks, budgets, act)



def test_activations_still_being_copied_out_are_used_where_they_are_on_gpu():
    """With the copies out lagging the forward (each held up on the d2h
    stream), the last streamed blocks' activations are still on the device
    when the backward begins: they are used there, not copied back ([Note:
    activations off the device]), compute waiting for their copies out
    before their memory is reused. The same gradients as all on the GPU."""
    d, n, rows = 1024, 12, 2048
    torch.manual_seed(0)
    model = Thin(d=d, n=n)
    ref = copy.deepcopy(model).to(GPU)
    budget = regime_budget(model, "streams") + activation_room(model, torch.zeros(rows, d), "offload")
    pager.wrap(model, budget=budget, device=GPU, activations="offload", budget_covers="pager")
    p = pager.of(model)
    send = p.transport.send_to_host

    def slow_send(t):
        with torch.cuda.stream(p.transport.d2h_stream):
            torch.cuda._sleep(10_000_000)
        return send(t)

    p.transport.send_to_host = slow_send
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.Adam(ref.parameters(), lr=1e-3)
    for step in range(3):
        x = torch.randn(rows, d, device=GPU)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    s = p.stats()
    assert s.activations_reused_bytes > 0 and s.activations_brought_bytes > 0
    assert s.activations_reused_bytes + s.activations_brought_bytes == s.activations_sent_bytes
    pager.unwrap(model)
    assert_close_to_reference(model, ref)

def test_activations_host_copies_lent_by_the_pool_and_back_after_each_backward():
    """Activations copied out land in pinned pieces of pager's pool ([Note:
    activations' host memory]), not torch's caching host allocator: every
    piece is back once its backward ran, the next steps reuse the same
    chunks (no growth for a fixed batch), with copies into a reused chunk
    held up behind the copies out of it (a sleep on each copy in). The same
    gradients as all on the GPU; unwrap unpins the pool."""
    d, n, rows = 1024, 8, 1024
    torch.manual_seed(0)
    model = Thin(d=d, n=n)
    ref = copy.deepcopy(model).to(GPU)
    budget = regime_budget(model, "streams") + activation_room(model, torch.zeros(rows, d), "offload")
    pager.wrap(model, budget=budget, device=GPU, activations="offload", budget_covers="pager")
    p = pager.of(model)
    bring = p.transport.bring_to_device

    def slow_bring(host, written=None):
        with torch.cuda.stream(p.transport.h2d_stream):
            torch.cuda._sleep(2_000_000)
        return bring(host, written)

    p.transport.bring_to_device = slow_bring
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.Adam(ref.parameters(), lr=1e-3)
    reserved = []
    for _step in range(4):
        x = torch.randn(rows, d, device=GPU)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        pool = p.transport._host_pool
        assert pool is not None and not pool._lent  # every piece back
        assert all(chunk.data.is_pinned() for chunk in pool._chunks)
        reserved.append(pool.reserved_bytes)
    assert p.stats().activations_brought_bytes > 0
    assert len(set(reserved)) == 1, reserved
    pager.unwrap(model)
    assert p.transport._host_pool is None
    assert_close_to_reference(model, ref)


def test_host_memory_pinned_in_huge_pages():
    """A pinned chunk starts on a huge page's boundary and is page-locked
    ([Note: pinning in huge pages]); copies to and from it are exact."""
    from pager.engine.host import HUGE_PAGE_BYTES, host_memory

    chunk = host_memory(3 << 20, pin=True)  # (a mapping of 5 MiB: the kernel may not align it on a huge page)
    try:
        assert chunk.data_ptr() % HUGE_PAGE_BYTES == 0 and chunk.is_pinned() and chunk[1 << 20 :].is_pinned()
        src = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8, device=GPU)
        chunk.copy_(src, non_blocking=True)
        back = torch.empty_like(src).copy_(chunk, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, src)
    finally:
        torch.cuda.cudart().cudaHostUnregister(chunk.data_ptr())


def activation_room(model, inputs, policy):
    """What activations hold at most under `policy` in a training pass of
    `model` on `inputs` on the GPU, by pager's prediction: the budget bounds
    them with the blocks."""
    from test_activations import activations_room

    return activations_room(model, inputs, policy, min_bytes=1 << 20, copies=True)


class WideDrop(nn.Module):
    """An MLP block with dropout: it saves about ten inputs' worth."""

    def __init__(self, d):
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.down(self.drop(torch.relu(self.up(x))))


def test_activations_recomputed_on_gpu_same_masks_and_peak():
    """Recomputed in the backward, with the blocks' fetches delayed (a missing
    wait reads weights not yet landed): the same dropout masks and gradients
    as all on the GPU, and an allocator peak of the blocks' inputs plus a few
    blocks' activations instead of all of them. "auto" chooses before the
    first pass, and again at the first step, with the optimizer's state
    (here a budget that holds recompute and offload), with the same
    results."""
    d, n, rows = 1024, 12, 2048
    act = rows * d * 4  # a block's input, fp32
    peaks = {}
    for activations in ("keep", "recompute", "auto"):
        room = 0 if activations == "keep" else activation_room(
            nn.Sequential(*[WideDrop(d) for _ in range(n)]), torch.zeros(rows, d), activations)
        model, ref, p, opt, ref_opt, budget = _wide_drop_training(
            d, n, activations, lambda m: int(2.5 * 4 * tensor_page_bytes(m[0])) + room)
        fused_twin = FusedTwin(ref)
        peak = 0
        for step in range(3):
            x = torch.randn(rows, d, device=GPU)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            if step == 1:
                p.reset()  # (the choice made again at the first step, with the optimizer's state: settled)
            torch.manual_seed(10 + step)
            model(x).pow(2).mean().backward()
            after = torch.rand(4, device=GPU)  # the generator goes on as if nothing ran again
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            if step:
                peak = max(peak, torch.cuda.max_memory_allocated() - base)
            torch.manual_seed(10 + step)
            ref(x).pow(2).mean().backward()
            assert torch.equal(after, torch.rand(4, device=GPU))
            ref_opt.step()
            ref_opt.zero_grad()
            fused_twin.step(x, 10 + step)
        peaks[activations] = peak
        s = p.stats()
        assert s.activations_policy in ({"offload", "recompute"} if activations == "auto" else {activations})
        assert (s.recomputes > 0) == (s.activations_policy == "recompute")
        assert (s.activations_sent_bytes > 0) == (s.activations_policy == "offload")
        pager.unwrap(model)
        assert_within(model, ref, fused_twin.spread(ref))
        del model, ref, opt, ref_opt, x
        torch.cuda.empty_cache()
    assert peaks["keep"] >= n * 10 * act, (peaks, budget, act)
    # Recomputed: every block's input, the last block's activations, and in
    # the backward one block's recomputed activations and their gradients.
    assert peaks["recompute"] <= budget + n * act + 3 * 10 * act, (peaks, budget, act)
    assert peaks["recompute"] < peaks["keep"], peaks


class FusedTwin:
    """A copy of a reference model trained beside it with torch's fused Adam
    on the GPU, to measure the spread of torch's own kernels (`kernel_spread`)."""

    def __init__(self, ref):
        self.model = copy.deepcopy(ref)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3, fused=True)

    def step(self, x, seed):
        torch.manual_seed(seed)
        self.model(x).pow(2).mean().backward()
        self.opt.step()
        self.opt.zero_grad()

    def spread(self, ref) -> float:
        return max((a - b).abs().max().item() for a, b in zip(self.model.state_dict().values(),
                                                               ref.state_dict().values()))


def _wide_drop_training(d, n, activations, budget_of):
    """`n` WideDrop blocks wrapped with `budget_of(model)` and `activations`,
    a reference copy on the GPU, and an Adam for each; cuBLAS workspaces made.
    The budget is pager's alone (the reference would count in the process's)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[WideDrop(d) for _ in range(n)])
    ref = copy.deepcopy(model).to(GPU)
    budget = budget_of(model)
    pager.wrap(model, budget=budget, device=GPU, activations=activations, budget_covers="pager")
    p = pager.of(model)
    _sleepy(p.transport)
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.Adam(ref.parameters(), lr=1e-3)
    w = torch.randn(8, 8, device=GPU, requires_grad=True)
    (w @ w).sum().backward()  # cuBLAS workspaces, before measuring
    return model, ref, p, opt, ref_opt, budget


def _steps_beside_reference(paged, reference, fused_twin, p, shape, steps, settled):
    """`steps` training steps of the wrapped model (`paged`: model and
    optimizer), its reference and the fused twin on the same inputs and
    dropout masks; `p`'s stats reset at step `settled`. Returns the
    allocator's peak over what is not pager's, of the steps from `settled` on."""
    peak = 0
    for step in range(steps):
        if step == settled:
            p.reset()
        x = torch.randn(*shape, device=GPU)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated() - p.resident_bytes  # what is not pager's
        torch.cuda.reset_peak_memory_stats()
        for i, (m, o) in enumerate((paged, reference)):
            torch.manual_seed(10 + step)
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
            if i == 0:
                torch.cuda.synchronize()
                if step >= settled:
                    peak = max(peak, torch.cuda.max_memory_allocated() - base)
        fused_twin.step(x, 10 + step)
    return peak


@pytest.mark.parametrize("activations", ["offload", "recompute"])
def test_one_budget_bounds_the_allocator_peak_on_gpu(activations):
    """[Note: one budget]: with activations paged, blocks get the budget less
    what activations held in the last pass, so the allocator's peak of a
    training step is the budget plus the documented slack (a block's
    temporaries while it runs and its gradients in the backward: here three
    blocks' activations), where blocks alone would fill the budget."""
    d, n, rows = 1024, 12, 2048
    act = rows * d * 4  # a block's input, fp32
    training_block = 4 * tensor_page_bytes(WideDrop(d))  # weights, grads, Adam's two states
    # Room for 3 blocks with about 4 blocks' activations.
    model, ref, p, opt, ref_opt, budget = _wide_drop_training(d, n, activations, lambda m: 3 * training_block + 40 * act)
    fused_twin = FusedTwin(ref)
    assert n * training_block > budget  # blocks alone would fill it
    # (from the second pass on, the last pass's activations are known, [Note: one budget], and state exists)
    peak = _steps_beside_reference((model, opt), (ref, ref_opt), fused_twin, p, (rows, d), steps=4, settled=2)
    s = p.stats()
    assert s.activation_reserve_bytes > 0 and s.peak_device_bytes <= budget, s
    assert peak <= budget + 3 * 10 * act, (peak, budget, act, s.peak_device_bytes)
    assert s.host_steps > 0  # (the default placement: [Note: the optimizer step on the host])
    pager.unwrap(model)
    assert_within(model, ref, fused_twin.spread(ref))


def test_the_state_leaves_the_device_on_gpu():
    """[Note: the state off the device]: at a budget that holds every block
    with its gradients and Adam's state but only two blocks' activations,
    the state goes to host memory and the updates run there; with copies
    delayed both ways (a missing wait reads gradients not yet down, or
    weights not yet up), within the budget and the allocator's slack, and
    less than the blocks with their state, the values within the spread of
    torch's own kernels."""
    d, n, rows = 1024, 12, 2048
    act = rows * d * 4  # a block's input, fp32
    training_block = 4 * tensor_page_bytes(WideDrop(d))  # weights, grads, Adam's two states
    model, ref, p, opt, ref_opt, budget = _wide_drop_training(d, n, "auto", lambda m: n * training_block + 20 * act)
    _sleepy(p.transport, h2d_cycles=0, d2h_cycles=1_000_000)
    fused_twin = FusedTwin(ref)
    # (from the eighth step on, "auto" has tried offload and recompute, and chosen)
    peak = _steps_beside_reference((model, opt), (ref, ref_opt), fused_twin, p, (rows, d), steps=10, settled=7)
    s, room = p.stats(), p.host_steps.state_room
    assert room.trading and room.state_bytes > 0 and s.host_steps > 0, (room.trading, room.state_bytes, s)
    assert s.peak_device_bytes <= budget - room.state_bytes // 2, s  # (the state is not there)
    assert peak <= budget + 3 * 10 * act, (peak, budget, act, s.peak_device_bytes)
    pager.unwrap(model)
    assert_within(model, ref, fused_twin.spread(ref))


def test_the_budget_covers_the_loss_on_gpu():
    """[Note: a budget that covers the process]: a cross-entropy over a wide
    projection outside the model (its logits, their log-softmax and the
    gradients of both: half a gigabyte) comes on top of the budget under
    budget_covers="pager"; by default (the process's budget) blocks leave it
    room, learned from the allocator, and the process's peak stays within the
    budget but for a block's temporaries; the values within the spread of
    torch's own kernels."""
    import torch.nn.functional as F

    d, n, rows, vocab, steps = 1024, 12, 2048, 16384, 8
    act = rows * d * 4  # a block's input, fp32
    budget = 8 * 4 * tensor_page_bytes(WideDrop(d)) + 20 * act  # 8 blocks with grads and Adam's state
    torch.manual_seed(0)
    head = torch.randn(d, vocab, device=GPU) / d ** 0.5
    xs = [torch.randn(rows, d, device=GPU) for _ in range(steps)]
    ys = [torch.randint(0, vocab, (rows,), device=GPU) for _ in range(steps)]
    w = torch.randn(8, 8, device=GPU, requires_grad=True)
    (w @ w).sum().backward()  # cuBLAS workspaces, before measuring
    start = nn.Sequential(*[WideDrop(d) for _ in range(n)])

    def train(model, opt, peak_from=steps):
        for i in range(steps):
            if i == peak_from:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            torch.manual_seed(10 + i)
            F.cross_entropy(model(xs[i]) @ head, ys[i]).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    peaks, outside = {}, 0
    for covers in ("pager", "process"):
        model = copy.deepcopy(start)
        base = torch.cuda.memory_allocated()  # (what this process held before: not the test's)
        # (optimizer state on the device: its blocks fill the budget on any host; "auto" may step on the host)
        pager.wrap(model, budget=budget, device=GPU, activations="recompute", optimizer_step="device",
                   **({"budget_covers": "pager"} if covers == "pager" else {}))  # (the default covers the process)
        p = pager.of(model)
        _sleepy(p.transport)
        peaks[covers] = train(model, torch.optim.Adam(model.parameters(), lr=1e-3), peak_from=4) - base
        outside = p.stats().outside_bytes
        pager.unwrap(model)
    assert outside > 3 * rows * vocab * 4, outside  # (the logits, log-softmax and a gradient at once, at least)
    assert peaks["process"] <= budget + 3 * 10 * act, (peaks, budget, outside)
    assert peaks["pager"] > peaks["process"] + outside // 2, (peaks, outside)
    ref, twin = copy.deepcopy(start).to(GPU), copy.deepcopy(start).to(GPU)
    train(ref, torch.optim.Adam(ref.parameters(), lr=1e-3))
    train(twin, torch.optim.Adam(twin.parameters(), lr=1e-3, fused=True))
    spread = max((a - b).abs().max().item() for a, b in zip(twin.state_dict().values(), ref.state_dict().values()))
    assert_within(model, ref, spread)


@pytest.mark.parametrize("activations", ["keep", "offload", "recompute"])
def test_unwrap_lets_the_pager_and_its_pinned_pages_go(activations):
    """A process that wraps models one after another gets its pinned host
    memory back: after unwrap, nothing holds the pager or its arena."""
    import gc
    import weakref

    room = 0 if activations == "keep" else activation_room(
        nn.Sequential(*[WideDrop(512) for _ in range(6)]), torch.zeros(256, 512), activations)
    model, ref, p, opt, ref_opt, budget = _wide_drop_training(
        512, 6, activations, lambda m: int(2.5 * 4 * tensor_page_bytes(m[0])) + room)
    for _ in range(2):
        model(torch.randn(256, 512, device=GPU)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    alive, arena = weakref.ref(p), weakref.ref(p.arena)
    pager.unwrap(model)
    del p, model, opt
    gc.collect()
    assert alive() is None and arena() is None, [type(r).__name__ for r in gc.get_referrers(alive())][:8]


def test_a_pool_serves_two_models_from_threads_on_gpu_with_delayed_copies():
    """Two models in one pool, requests from four threads with copies made
    slow: each output equals the unwrapped model's, the pool's blocks stay
    within its budget, and so does what the allocator holds for them."""
    torch.manual_seed(0)
    models = [Thin(n=8).to(GPU) for _ in range(2)]
    refs = [copy.deepcopy(m) for m in models]
    layer = tensor_page_bytes(models[0].layers[0])
    pool = pager.Pool(budget=5 * layer, device="cuda")
    for i, m in enumerate(models):
        pager.wrap(m, pool=pool, name=f"m{i}")
    _sleepy(pool.engine.transport, h2d_cycles=500_000)
    xs = [torch.randn(16, 1024, device=GPU) for _ in range(3)]
    with torch.no_grad():
        want = [[r(x) for x in xs] for r in refs]

    def serve(t):
        for k in range(12):
            i, j = (t + k) % 2, k % 3
            with torch.no_grad():
                torch.testing.assert_close(models[i](xs[j]), want[i][j], rtol=0, atol=0)

    assert run_threads(serve, 4) == []
    s = pool.stats()
    assert s.peak_resident_bytes <= pool.budget_bytes and s.timeouts == 0
    assert s.models["m0"].misses > 0 and s.models["m1"].misses > 0


def test_generate_on_gpu_in_a_pool_matches_unwrapped():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(GPU).eval()
    other = transformers.LlamaForCausalLM(config).to(GPU).eval()
    ref = copy.deepcopy(model)
    layer = tensor_page_bytes(model.model.layers[0])
    rest = tensor_page_bytes(model) - 6 * layer
    pool = pager.Pool(budget=2 * rest + 4 * layer, device="cuda")
    pager.wrap(model, pool=pool, name="chat")
    pager.wrap(other, pool=pool, name="other")
    ids = torch.randint(0, 256, (2, 7), device=GPU)
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        other.generate(ids, **kw)  # the other model takes room first
        out = model.generate(ids, **kw)
        want = ref.generate(ids, **kw)
    assert torch.equal(out, want)
    s = pool.stats()
    assert s.models["chat"].misses > 0 and s.models["chat"].peak_carried_bytes > 0
    assert s.peak_resident_bytes <= pool.budget_bytes


@pytest.mark.parametrize("batch,compute_sleep", [(1, 0), (4, 2_000_000)])
def test_generate_with_delayed_copies_equals_the_bare_model(batch, compute_sleep):
    """Decode streams blocks across token boundaries (the next token's first
    blocks come while this one's last compute), with the KV cache growing
    in the budget: with every copy delayed (and compute too), the tokens
    are those of the model all on the GPU."""
    model, ref, budget = streamed_llama(128, GPU)
    pager.wrap(model, budget=budget, device=GPU, budget_covers="pager")
    _sleepy(pager.of(model).transport, compute_cycles=compute_sleep)
    ids = torch.randint(0, 256, (batch, 7), device=GPU)
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    for pad in (True, False):  # (without pad_token_id generate sets it and warns)
        extra = {"pad_token_id": 0} if pad else {}
        out = model.generate(ids, **kw, **extra)
        want = ref.generate(ids, **kw, **extra)
        assert torch.equal(out, want)
    s = pager.of(model).stats()
    assert s.prefetches > 0 and s.evictions > 0 and s.peak_carried_bytes > 0


# ------------------------------------------------------------ compressed pages
def _codec_segment():
    """Tensors of every kind a codec meets: trained-like bf16 with escapes
    (and non-finite values: raw under the lossy codecs) sprinkled in, and
    without, an odd length, fp32 and fp16 matrices, and small tensors."""
    from test_compress import _bf16_patterns

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(700, 513, generator=g) * 0.02).bfloat16().flatten()
    w[::101] = _bf16_patterns(w[::101].numel())
    named = [("w", w.view(700, 513)), ("v", (torch.randn(600, 512, generator=g) * 0.02).bfloat16()),
             ("odd", (torch.randn(3, 4099, generator=g) * 0.1).bfloat16()),
             ("f32", torch.randn(300, 64, generator=g)), ("f16", torch.randn(128, 96, generator=g).half()),
             ("norm", torch.ones(513, dtype=torch.bfloat16)), ("ids", torch.arange(9))]
    from pager.base.block import layout

    slots, nbytes = layout(named)
    plain = torch.zeros(nbytes, dtype=torch.uint8)
    for slot, (_n, t) in zip(slots, named):
        slot.view_of(plain).copy_(t)
    return slots, plain


@pytest.mark.parametrize("codec", ["lossless", "fp8", "int4"])
def test_compressed_pages_decode_on_gpu_as_the_cpu_reference(codec, monkeypatch):
    """The Triton decoders give the reference decoder's bytes on the same
    pages (several pieces each), and encoding on the GPU gives the CPU's page."""
    import pager.codec.compress as C
    from pager.codec.kernels import decode_on_device, triton

    assert triton is not None  # the kernels are under test, not the fallback
    monkeypatch.setattr(C, "PIECE_BYTES", 1 << 16)
    slots, plain = _codec_segment()
    encoded, page = C.encode(codec, slots, plain)
    on_gpu, gpu_page = C.encode(codec, slots, plain, device=GPU)
    assert on_gpu == encoded and torch.equal(gpu_page, page)
    assert len([p for p in encoded.pieces if p.kind != "raw"]) >= 4  # several pieces, through the ring
    if codec == "lossless":
        assert sum(p.escapes for p in encoded.pieces) > 1000
    want = C.decoded_copy(page, encoded)
    staged = page.to(GPU)
    out = torch.zeros(plain.numel(), dtype=torch.uint8, device=GPU)
    for piece in encoded.pieces:
        decode_on_device(staged[piece.src: piece.src + piece.src_bytes], piece,
                         out[piece.dst: piece.dst + piece.dst_bytes])
    assert torch.equal(out.cpu(), want)
    if codec == "lossless":
        assert torch.equal(want, plain)


def _slow_decodes(transport, cycles=1_000_000):
    """Delay each compressed fetch's copies and its decodes: a missing wait
    reads a staging slot not yet filled, or storage not yet decoded."""
    h2d_encoded = transport.h2d_encoded

    def slow(device_flat, page, encoded, after=()):
        with torch.cuda.stream(transport.h2d_stream):
            torch.cuda._sleep(cycles)
        with torch.cuda.stream(transport.decode_stream):
            torch.cuda._sleep(cycles)
        return h2d_encoded(device_flat, page, encoded, after)

    transport.h2d_encoded = slow


@pytest.mark.parametrize("codec", ["lossless", "fp8", "int4"])
def test_compressed_forward_on_gpu_with_delayed_copies_and_the_budget(codec, monkeypatch):
    import pager.codec.compress as C

    monkeypatch.setattr(C, "PIECE_BYTES", 1 << 19)  # several pieces a layer: the staging ring turns over
    model = Thin(n=10).bfloat16().eval()
    layer = tensor_page_bytes(model.layers[0])
    budget = 3 * layer + 3 * (1 << 19) + 4096  # two or three layers and the staging ring
    pager.wrap(model, budget=budget, device=GPU, compress=codec, budget_covers="pager")
    p = pager.of(model)
    assert p.transport.staging_bytes > 0 and p.stats().compressed_blocks == 10
    ref = Thin(n=10).bfloat16().to(GPU).eval()
    ref.load_state_dict(model.state_dict())  # the decoded weights (exactly the originals for lossless)
    _slow_decodes(p.transport)
    xs = [torch.randn(8, 1024, device=GPU, dtype=torch.bfloat16) for _ in range(4)]
    with torch.no_grad():
        model(xs[0]), ref(xs[0])  # (kernels compiled, workspaces made)
    p.reset()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    s = p.stats()
    assert s.evictions > 0 and s.prefetches > 0
    assert s.h2d_bytes < 0.8 * 4 * 10 * layer  # what crossed the link is the compressed pages
    # The staging ring is inside the budget; beside it only the small activations.
    assert s.peak_resident_bytes + p.transport.staging_bytes <= budget
    assert peak <= budget + 8 * 8 * 1024 * 2 * 4, (peak, budget, torch.cuda.memory_summary())


def test_training_on_gpu_with_compressed_pages():
    model = TinyLM().bfloat16()
    ref = copy.deepcopy(model).to(GPU)
    pager.wrap(model, budget=regime_budget(model, "streams"), device=GPU, compress="lossless", optimizer_step="device", budget_covers="pager")
    assert pager.of(model).stats().compressed_blocks == len(model.layers)
    opt, ref_opt = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](ref.parameters())
    data = [(a.to(GPU), b.to(GPU)) for a, b in batches(6)]
    train(model, opt, data)
    train(ref, ref_opt, data)
    assert pager.of(model).stats().compressed_blocks < len(model.layers)
    pager.unwrap(model)
    assert_close_to_reference(model, ref, rtol=None, atol=None)  # (bf16's tolerance)


def test_a_budget_the_staging_ring_crowds_warns_and_runs(pager_log):
    model = Thin(n=4).bfloat16().eval()
    ref = Thin(n=4).bfloat16().to(GPU).eval()
    layer = tensor_page_bytes(model.layers[0])
    pager.wrap(model, budget=layer + 4096, device=GPU, compress="lossless")
    assert "staging ring of compressed pages" in pager_log.text
    ref.load_state_dict(model.state_dict())
    x = torch.randn(2, 1024, device=GPU, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


# ------------------------------------------------------------- row tables
@pytest.mark.parametrize("cache", [0, 200 * 64 * 4, 10**7])
def test_row_tables_on_gpu_match_the_table_on_gpu(cache):
    """Rows read from the mapped host table, from the device cache, and written back: the same
    training as the model with its table on the GPU (SparseAdam and Adam, sparse and dense tables)."""
    from pager.rows.tensors import RowTableParameter

    torch.manual_seed(0)

    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5000, 64, sparse=True, padding_idx=0)
            self.bag = nn.EmbeddingBag(3000, 64, mode="mean")
            self.mlp = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))

        def forward(self, ids, bag_ids, offsets):
            return self.mlp(self.emb(ids).sum(1) + self.bag(bag_ids, offsets)).square().mean()

    ref = Rec().to(GPU)
    model = copy.deepcopy(ref).cpu()
    pager.wrap(model, budget="64MiB", rows=["emb", "bag"], row_cache=cache, budget_covers="pager")  # (ref is beside)
    assert type(model.emb.weight) is RowTableParameter and model.emb.weight.device.type == "cpu"

    def opts(m):
        return [torch.optim.SparseAdam(list(m.emb.parameters()), lr=1e-2),
                torch.optim.Adam(list(m.bag.parameters()) + list(m.mlp.parameters()), lr=1e-2)]

    ro, po = opts(ref), opts(model)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        ids = torch.randint(0, 600, (32, 8), generator=g).to(GPU)  # rows come back: cache hits
        ids[0, 0] = 0
        bag_ids = torch.arange(3000, device=GPU)[torch.randperm(3000, generator=g).to(GPU)][:96]
        bag_ids = torch.cat([bag_ids, torch.arange(3000, device=GPU)])  # every bag row, every step: lazy = dense
        offsets = torch.arange(0, bag_ids.numel(), bag_ids.numel() // 32, device=GPU)[:32]
        for m, os_ in ((ref, ro), (model, po)):
            m(ids, bag_ids, offsets).backward()
            for o in os_:
                o.step()
            for o in os_:
                o.zero_grad()
    for name in ("emb", "bag"):
        torch.testing.assert_close(getattr(model, name).weight.detach(), getattr(ref, name).weight.detach().cpu(),
                                   rtol=1e-4, atol=1e-5)
    for a, b in zip(model.mlp.parameters(), ref.mlp.parameters()):
        torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), rtol=1e-4, atol=1e-5)
    s = pager.of(model).stats()
    assert s.row_misses > 0 and (cache < 200 * 64 * 4 * 3 or s.row_hits > 0)
    pager.unwrap(model)


class RowRec(nn.Module):
    """A recommender's shape: an EmbeddingBag table (sparse gradients) and a linear head."""

    def __init__(self, n_rows, dim):
        super().__init__()
        self.emb = nn.EmbeddingBag(n_rows, dim, mode="sum", sparse=True)
        self.head = nn.Linear(dim, 1)

    def forward(self, ids, offsets):
        return self.head(self.emb(ids, offsets)).square().mean()


def _train_side_by_side(ref, model, ro, po, data, offsets, read_ahead, after_step=None):
    """Train `ref` (its table on the GPU) and `model` (row-paged) on the same batches; where
    `read_ahead(i)`, the paged model reads the rows of batch i + 1 ahead during step i."""
    for i, ids in enumerate(data):
        ref(ids, offsets).backward()
        loss = model(ids, offsets)
        if read_ahead(i) and i + 1 < len(data):
            pager.of(model).expect_rows(model.emb, data[i + 1])
        loss.backward()
        for o in ro + po:
            o.step()
        for o in ro + po:
            o.zero_grad()
        if after_step is not None:
            after_step(i)


@pytest.mark.parametrize("ahead", [False, True])
def test_changed_rows_written_back_on_gpu_match_the_table_on_gpu(ahead):
    """[Note: write-back of cached rows] on the GPU: a cache smaller than the rows that come back, so
    changed rows leave it (copied out by the copy engine and stored by the writer's thread while compute
    runs on: [Note: rows written back by the host]) and are read again,
    with and without rows read ahead (some of them while their write-back runs); reads of the weight
    and of SparseAdam's state in the middle see every change."""
    torch.manual_seed(0)
    n_rows, dim = 20_000, 32

    ref = RowRec(n_rows, dim).to(GPU)
    model = copy.deepcopy(ref).cpu()
    slot = dim * 4 * 3 + 17  # (a weight row, two state rows, the slot's bookkeeping)
    pager.wrap(model, budget="256MiB", rows=["emb"], row_cache=2500 * slot + 4 * (n_rows + 1))
    p = pager.of(model)

    def opts(m):
        return [torch.optim.SparseAdam(list(m.emb.parameters()), lr=1e-2),
                torch.optim.SGD(m.head.parameters(), lr=0.01)]

    ro, po = opts(ref), opts(model)
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 6000, (2048,), generator=g).to(GPU) for _ in range(12)]
    offsets = torch.arange(0, 2048, 16, device=GPU)

    def after_step(i):
        if i == 1:
            p.reset()  # (the first step wrote its rows through: it made the state columns)
        if i == 6:
            assert p.stats().row_flushes == 0 and p.stats().row_d2h_bytes > 0
            torch.testing.assert_close(model.emb.weight[:6000].detach(), ref.emb.weight[:6000].detach().cpu(),
                                       rtol=1e-5, atol=1e-6)

    _train_side_by_side(ref, model, ro, po, data, offsets, lambda i: ahead, after_step)
    torch.testing.assert_close(model.emb.weight.detach(), ref.emb.weight.detach().cpu(), rtol=1e-5, atol=1e-6)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(po[0].state[model.emb.weight][key], ro[0].state[ref.emb.weight][key].cpu(),
                                   rtol=1e-5, atol=1e-6)
    assert p.row_tables[0].cache.capacity < 2500 and (not ahead or p.stats().row_ahead_hits > 0)
    pager.unwrap(model)


def _syncs(fn) -> int:
    """Host syncs `fn()` makes (torch's sync debug mode, as warnings)."""
    import warnings

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("optimizer", ["sgd", "sparse_adam"])
def test_a_step_whose_rows_were_read_ahead_adds_no_host_sync(optimizer):
    """[Note: rows read ahead]: with expect_rows of each next batch, a training step whose rows cross the
    link (the cache full: each row taken in puts a changed one out, written back by the writer's thread)
    makes no host sync beyond those the model makes with its table on the GPU, and trains the same."""
    torch.manual_seed(0)
    n_rows, per_step, dim = 100_000, 4096, 32

    ref = RowRec(n_rows, dim).to(GPU)
    model = copy.deepcopy(ref).cpu()
    slot = dim * 4 * (3 if optimizer == "sparse_adam" else 1) + 17  # (weight and state rows, bookkeeping)
    pager.wrap(model, budget="256MiB", rows=["emb"], row_cache=3 * per_step * slot + 4 * (n_rows + 1),
               budget_covers="pager")  # (the reference table and its optimizer state beside it on the GPU)
    p = pager.of(model)

    def opts(m):
        table = (torch.optim.SparseAdam(list(m.emb.parameters()), lr=1e-2) if optimizer == "sparse_adam"
                 else torch.optim.SGD(m.emb.parameters(), lr=0.5))
        return [table, torch.optim.SGD(m.head.parameters(), lr=0.01)]

    ro, po = opts(ref), opts(model)
    g = torch.Generator().manual_seed(4)
    data = [torch.randperm(n_rows, generator=g)[:per_step].to(GPU) for _ in range(16)]
    offsets = torch.arange(0, per_step, 16, device=GPU)

    def step(m, os_, i, ahead):
        loss = m(data[i], offsets)
        if ahead and i + 1 < len(data):
            p.expect_rows(m.emb, data[i + 1])
        loss.backward()
        for o in os_:
            o.step()
        for o in os_:
            o.zero_grad()

    syncs = {"ref": [], "paged": []}
    for i in range(len(data)):
        syncs["ref"].append(_syncs(lambda: step(ref, ro, i, False)))
        syncs["paged"].append(_syncs(lambda: step(model, po, i, True)))
    assert p.row_tables[0].cache.capacity < 4 * per_step  # (from the fifth step on, rows leave the cache)
    assert syncs["paged"][6:] == syncs["ref"][6:], syncs
    torch.testing.assert_close(model.emb.weight.detach(), ref.emb.weight.detach().cpu(), rtol=1e-5, atol=1e-6)
    s = p.stats()
    assert s.row_ahead_hits > 0 and s.row_d2h_bytes > 0
    pager.unwrap(model)


def test_row_kernels_equal_their_torch_references(monkeypatch):
    """[Note: few launches on the row path]: each Triton kernel of the row path (numbering lookups, touching
    hits, placing rows with and without taking changed ones out, reading marked rows, taking rows from a
    write-back's copy) leaves exactly what its torch reference leaves, on batches with repeats, a padding row,
    rows whose write-back is in flight."""
    from pager.rows import kernels as K
    if K.triton is None:
        pytest.skip("no Triton")
    real = K.uses_kernels
    g = torch.Generator().manual_seed(0)

    def both(fn):
        a = fn()
        monkeypatch.setattr(K, "uses_kernels", lambda t: False)
        try:
            return a, fn()
        finally:
            monkeypatch.setattr(K, "uses_kernels", real)

    for n_rows, n, cap in ((50, 1, 25), (1000, 40, 500), (50_000, 9000, 20_000)):
        idx = torch.randint(0, n_rows, (n,), generator=g).to(GPU)
        slot_of_row = torch.full((n_rows + 1,), -1, dtype=torch.int32, device=GPU)
        held = torch.randperm(n_rows, generator=g)[:cap].to(GPU)
        slot_of_row[held] = torch.arange(cap, dtype=torch.int32, device=GPU)
        gone = torch.randperm(n_rows, generator=g)[: n_rows // 10].to(GPU)
        gone = gone[slot_of_row[gone] < 0]
        slot_of_row[gone] = torch.randint(-6, -1, (gone.numel(),), generator=g, dtype=torch.int32).to(GPU)
        for pad in (None, int(idx[0])):
            for stale_below in (K.NO_STALE, K.mark_of(2)):
                for cached, most in ((slot_of_row, K._NUMBER_BLOCKS), (None, K._NUMBER_BLOCKS), (slot_of_row, 2)):
                    monkeypatch.setattr(K, "_NUMBER_BLOCKS", most)  # (2: blocks larger than one, made to fit)
                    a, b = both(lambda: K.number_lookups(idx, n_rows, cached, pad, GPU, stale_below))
                    m = int(b.facts[3])
                    assert torch.equal(a.facts, b.facts)
                    for f in ("rows", "need", "stale", "inverse", "missing"):
                        assert torch.equal(getattr(a, f), getattr(b, f)), f
                    assert torch.equal(a.rank[b.need], b.rank[b.need])
        monkeypatch.undo()
        lookups = K.number_lookups(idx, n_rows, slot_of_row, None, GPU, K.mark_of(2))
        u, m = int(lookups.facts[2]) + 1, int(lookups.facts[3])
        assert m <= cap - (u - m) and m > 0
        values = torch.randn(n, 8, generator=g).to(GPU)
        row_of_slot = torch.full((cap,), n_rows, dtype=torch.long, device=GPU)
        row_of_slot[slot_of_row[held].long()] = held
        for by_rank in (False, True):
            for take_out in (False, True):
                def place():
                    state = K.CacheMap(slot_of_row.clone(), row_of_slot.clone(),
                                       torch.randint(0, 9, (cap,), generator=torch.Generator().manual_seed(1)).to(GPU),
                                       (torch.rand(cap + 1, generator=torch.Generator().manual_seed(2)) < 0.5).to(GPU),
                                       torch.randn(cap + 1, 8, generator=torch.Generator().manual_seed(3)).to(GPU))
                    K.touch_hits(lookups, u, state.slot_of_row, state.last_use, 10)
                    victims = torch.topk(state.last_use, m, largest=False).indices
                    return state, *K.place_rows(lookups, u, values, by_rank, state, victims, 10, K.mark_of(7), take_out)

                (sa, out_a, slots_a, taken_a), (sb, out_b, slots_b, taken_b) = both(place)
                for x, y in zip(sa, sb):
                    assert torch.equal(x, y)
                assert torch.equal(out_a, out_b) and torch.equal(slots_a, slots_b)
                assert (taken_a is None) == (not take_out)
                assert all(torch.equal(x, y) for x, y in zip(taken_a or (), taken_b or ()))
                at = lookups.rank[:u].where(lookups.need[:u], 0) if by_rank else torch.arange(u, device=GPU)
                expected = torch.where(lookups.need[:u, None], values[at], sb.column[slots_b])
                assert torch.equal(out_a, expected)
        view = torch.randn(n_rows, 8, generator=g).to(GPU)
        a, b = both(lambda: K.read_where(view, lookups.rows, lookups.need, torch.zeros(n, 8, device=GPU)))
        assert torch.equal(a, b)
        written_rows = torch.randperm(n_rows, generator=g)[: max(1, cap // 3)].sort().values.to(GPU)
        written = torch.randn(written_rows.numel(), 8, generator=g).to(GPU)
        for which in (None, lookups.stale):
            def patched():
                out = view[lookups.rows.clamp(max=n_rows - 1)]
                K.patch_written(out, lookups.rows, written_rows, written, which)
                return out
            a, b = both(patched)
            assert torch.equal(a, b)
            among = torch.isin(lookups.rows, written_rows) & (True if which is None else which)
            assert torch.equal((a != view[lookups.rows.clamp(max=n_rows - 1)]).any(1), among)


@pytest.mark.parametrize("share", [0.1, 0.9, None])
def test_row_reads_split_between_kernel_and_cpu_are_exact(share):
    """Missed rows read by the kernel and by CPU threads at once ([Note: two paths for scattered rows]),
    at a fixed share and the learned one, with rows read ahead ([Note: rows read ahead]): the same
    training as the table on the GPU."""
    from pager.rows.reader import SPLIT_MIN_ROWS

    torch.manual_seed(0)
    n_rows, per_step = 200_000, 3 * SPLIT_MIN_ROWS

    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.EmbeddingBag(n_rows, 32, mode="sum", sparse=True)
            self.head = nn.Linear(32, 1)

        def forward(self, ids, offsets):
            return self.head(self.emb(ids, offsets)).square().mean()

    ref = Rec().to(GPU)
    model = copy.deepcopy(ref).cpu()
    pager.wrap(model, budget="256MiB", rows=["emb"], row_cache=0)
    p = pager.of(model)
    reader = p.row_tables[0].readers["weight"]
    if share is not None:
        reader.mapped_share, reader.learn = share, False
    rows = torch.randperm(n_rows, device=GPU)[:per_step].sort().values
    assert torch.equal(reader.read(rows).cpu(), model.emb.weight.detach()[rows.cpu()])

    def opts(m):
        return [torch.optim.SGD(m.emb.parameters(), lr=0.5), torch.optim.SGD(m.head.parameters(), lr=0.01)]

    ro, po = opts(ref), opts(model)
    g = torch.Generator().manual_seed(2)
    data = [torch.randint(0, n_rows, (per_step,), generator=g).to(GPU) for _ in range(5)]
    offsets = torch.arange(0, per_step, 64, device=GPU)
    _train_side_by_side(ref, model, ro, po, data, offsets, lambda i: i % 2 == 0)
    torch.testing.assert_close(model.emb.weight.detach(), ref.emb.weight.detach().cpu(), rtol=1e-5, atol=1e-6)
    s = p.stats()
    assert s.row_ahead_hits > 0 and s.row_misses >= 5 * SPLIT_MIN_ROWS
    if share is None:  # both ways measured on the reads themselves
        assert all(v is not None and v > 0 for v in reader.row_seconds.values()), reader.row_seconds
        assert 0.1 <= reader.mapped_share <= 0.9
    pager.unwrap(model)


def _checkpoint(tmp_path, model):
    st = pytest.importorskip("safetensors.torch")
    sd = {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k != "head.weight"}
    st.save_file(sd, str(tmp_path / "model.safetensors"))
    return tmp_path / "model.safetensors"


def test_load_from_disk_on_gpu_matches_the_model_on_gpu(tmp_path):
    big = dict(vocab=64, d=256, n_layers=8)  # ~3 MiB layers: weights read with O_DIRECT where the disk allows
    ref = TinyLM(**big).to(GPU)
    path = _checkpoint(tmp_path, ref)
    with torch.device("meta"):
        model = TinyLM(**big)
    layer = tensor_page_bytes(ref.layers[0])
    pager.load(model, path, budget=3 * layer + (1 << 20), host_budget=3 * layer)
    _sleepy(pager.of(model).transport)  # a page reused before its copy up ended would show
    ids = batches(1)[0][0].to(GPU)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(ids), ref(ids), rtol=0, atol=0)
    s = pager.of(model).stats()
    assert s.disk_read_bytes > 2 * sum(tensor_page_bytes(m) for m in ref.layers)
    assert "measured sequential peak" in pager.of(model).report()


def test_training_from_disk_with_spill_on_gpu_matches_the_model_on_gpu(tmp_path):
    big = dict(vocab=64, d=256, n_layers=8)
    ref = TinyLM(**big).to(GPU)
    path = _checkpoint(tmp_path, ref)
    with torch.device("meta"):
        model = TinyLM(**big)
    layer = tensor_page_bytes(ref.layers[0])
    pager.load(model, path, budget=6 * layer + (1 << 20), host_budget=8 * layer, spill=tmp_path / "spill",
               budget_covers="pager")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    data = [(x.to(GPU), y.to(GPU)) for x, y in batches(5)]
    train(model, opt, data)
    train(ref, ref_opt, data)
    s = pager.of(model).stats()
    assert s.spills > 0
    pager.unwrap(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.to(GPU), q, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ adapters (LoRA)
@pytest.mark.parametrize("compress,adapters_resident", [(None, True), (None, False), ("int4", True)])
def test_lora_on_gpu_with_delayed_copies_equals_all_on_gpu(compress, adapters_resident):
    """peft LoRA on a Llama whose frozen layers stream ([Note: frozen pages],
    [Note: adapters stay on the device]): with every copy delayed, training
    equals the model all on the GPU (holding the weights as the pages decode
    them), nothing frozen is written back, and blocks with recomputed
    activations hold the budget from the first pass on."""
    from test_adapters import ATTENTION, peft_llama, peft_train, trainable

    model = peft_llama(ATTENTION, hidden=512, layers=4)
    total = tensor_page_bytes(model)
    adapters = sum(p.numel() * p.element_size() for p in trainable(model))
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long), "labels": torch.zeros(2, 16, dtype=torch.long)}
    if adapters_resident:
        budget = max(int(0.45 * total), 32 * adapters)
    else:  # (the budget bounds the activations too: pager's plan on the GPU, for the blocks that budget makes)
        saved = pager.plan(model, int(0.3 * total), device=GPU, inputs=batch, budget_covers="pager").saved
        budget = int(0.3 * total) + saved.peak("recompute", min_bytes=1 << 20, copies=True)
    assert budget < total and (budget >= 32 * adapters) == adapters_resident
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=budget, device=GPU, compress=compress, activations="recompute", budget_covers="pager")
    p = pager.of(model)
    assert any(b.trainable for b in p.blocks) != adapters_resident
    if compress:
        ref.load_state_dict(model.state_dict())  # the frozen weights as their pages decode them
    ref.to(GPU)
    _sleepy(p.transport, compute_cycles=1_000_000)
    opt, ref_opt = (torch.optim.AdamW(trainable(m), lr=1e-3) for m in (model, ref))
    for step in range(3):
        p.reset()  # (each step on its own: from the first, within the budget)
        peft_train(model, opt, 1, first=step, device=GPU)
        peft_train(ref, ref_opt, 1, first=step, device=GPU)
        s = p.stats()
        assert s.evictions > 0 and s.peak_device_bytes <= budget, (step, s)
    if adapters_resident:
        assert s.d2h_bytes == 0
    pager.unwrap(model)
    for (n, a), (_n, b) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(a.to(GPU), b, rtol=1e-4, atol=1e-5, msg=n)


# ------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("how", ["blocks", "whole"])
def test_compiled_model_on_gpu_with_delayed_copies_equals_the_compiled_model(how):
    """[Note: pager under torch.compile]: inductor's graphs on the GPU, blocks
    paging in and out with every copy delayed: training (and inference) equal
    the model with its layers compiled all on the GPU (the graphs a paged
    model gets, compiled whole or by block: inductor fuses nothing across a
    block's hooks), with no recompilation."""
    from torch._dynamo.testing import CompileCounterWithBackend

    if os.environ.get("TORCH_CUDA_SANITIZER"):
        pytest.skip("torch.compile compiles nothing under the CUDA sanitizer (its dispatch mode turns dynamo off)")
    torch._dynamo.reset()
    model = TinyLM(d=256)
    ref = copy.deepcopy(model).to(GPU)
    layer = tensor_page_bytes(model.layers[0])
    rest = tensor_page_bytes(model) - len(model.layers) * layer
    counter, ref_counter = CompileCounterWithBackend("inductor"), CompileCounterWithBackend("inductor")
    for b in ref.layers:
        b.compile(backend=ref_counter)
    if how == "blocks":
        for a in model.layers:
            a.compile(backend=counter)
    pager.wrap(model, budget=4 * (rest + 3 * layer), device=GPU, budget_covers="pager")
    _sleepy(pager.of(model).transport, compute_cycles=500_000)
    run, ref_run = (model if how == "blocks" else torch.compile(model, backend=counter)), ref
    # SGD: AdamW would turn the rounding noise of a gradient that is zero in
    # exact arithmetic (attention's key bias) into steps of the full rate.
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (model, ref))
    frames = []
    for x, y in batches(5):
        x, y = x.to(GPU), y.to(GPU)
        for m, o in ((run, opt), (ref_run, ref_opt)):
            lm_loss(m, x, y).backward()
            o.step()
            o.zero_grad()
        frames.append(counter.frame_count)
    assert frames[-1] >= 1 and frames[-1] == frames[2], frames
    with torch.no_grad():
        x = batches(1)[0][0].to(GPU)
        torch.testing.assert_close(run(x), ref_run(x), rtol=1e-4, atol=1e-5)
    assert pager.of(model).stats().evictions > 0
    pager.unwrap(model)
    assert_close_to_reference(model, ref)
    torch._dynamo.reset()


# ------------------------------------------------------------ quantized weights
@pytest.mark.parametrize("kind", ["written out", "torchao int8", "torchao fp8"])
def test_quantized_weights_on_gpu_with_delayed_copies_equal_all_on_gpu(kind):
    """[Note: wrapper-subclass weights]: quantized weights stream by their
    inner tensors onto the GPU, where their own kernels run; with every copy
    delayed, inference and adapters' training equal the quantized model all
    on the GPU, and the blocks stay within the budget. After unwrap the
    weights are back on the CPU."""
    from test_quantized import Adapted, inputs
    from quantized import QuantizedWeight, quantized_bytes

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(*(Adapted(d=1024) for _ in range(8)))
        for m in model:
            m.base.bias.requires_grad_(False)
            if kind == "written out":
                m.base.weight = nn.Parameter(QuantizedWeight.of(m.base.weight), requires_grad=False)
        if kind.startswith("torchao"):
            quantization = pytest.importorskip("torchao.quantization")
            config = quantization.Int8WeightOnlyConfig() if kind == "torchao int8" else \
                quantization.Float8WeightOnlyConfig()
            quantization.quantize_(model, config, filter_fn=lambda m, _fqn: isinstance(m, nn.Linear))
        return model

    model, ref = make(), make().to(GPU)
    weight = model[3].base.weight
    budget = int(3.5 * quantized_bytes(model[0]))
    pager.wrap(model, budget=budget, device=GPU, activations="recompute", budget_covers="pager")
    assert weight.device.type == "cuda" and model[3].base.weight is weight
    p = pager.of(model)
    _sleepy(p.transport, compute_cycles=1_000_000)
    x = inputs(d=1024).to(GPU)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))
    trainable = [[q for q in m.parameters() if q.requires_grad] for m in (model, ref)]
    opt, ref_opt = (torch.optim.AdamW(t, lr=1e-3) for t in trainable)
    torch.cuda.reset_peak_memory_stats()
    for step in range(3):
        if step == 1:
            p.reset()  # (the first pass learns what the activations need)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(inputs(step, d=1024).to(GPU)).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    s = p.stats()
    # (blocks; the activations hold what the quantized kernels save, a dequantized copy of each weight)
    assert s.evictions > 0 and s.peak_resident_bytes <= budget, s
    for a, b in zip(*trainable):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    pager.unwrap(model)
    assert weight.device.type == "cpu" and weight.qdata.device.type == "cpu"


def test_torchao_float8_training_pages_like_plain_weights():
    """torchao's float8 training (`convert_to_float8_training`) keeps plain
    weights and casts them in each forward: they page as any, and training
    under a streaming budget equals the converted model all on the GPU."""
    float8 = pytest.importorskip("torchao.float8")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9 or more")

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(512, 1024, bias=False), nn.GELU(),
                                              nn.Linear(1024, 512, bias=False)) for _ in range(6)))
        return float8.convert_to_float8_training(model.to(torch.bfloat16))

    model, ref = make(), make().to(GPU)
    budget = int(2.5 * 4 * tensor_page_bytes(model[0]))  # (weights, gradients and Adam's state of 2.5 layers)
    pager.wrap(model, budget=budget, device=GPU, budget_covers="pager")
    p = pager.of(model)
    _sleepy(p.transport)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    for step in range(3):
        x = torch.randn(64, 512, device=GPU, dtype=torch.bfloat16, generator=torch.Generator(GPU).manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).float().pow(2).mean().backward()
            o.step()
            o.zero_grad()
    assert p.stats().evictions > 0
    pager.unwrap(model)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.to(GPU), b, rtol=1e-2, atol=1e-3)
