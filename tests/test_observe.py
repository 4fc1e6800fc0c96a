"""Stats, report, trace, plan and warnings: what the pager tells its user."""

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn

import pager
from helpers import tensor_page_bytes
from models import TinyLM


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cyclic(n=6, d=64):
    return nn.Sequential(*[nn.Linear(d, d) for _ in range(n)])


def test_report_has_the_table_the_link_and_the_host():
    model = cyclic()
    pager.wrap(model, budget=3 * tensor_page_bytes(model[0]), device="cpu")
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 64))
    text = pager.of(model).report()
    for needle in ("block", "fetches", "stall ms", "GB/s", "measured peak", "host:", "host pages"):
        assert needle in text, needle
    s = pager.of(model).stats()
    assert s.h2d_seconds > 0 and s.h2d_gbps > 0
    assert all(b.h2d_bytes == b.fetches * b.nbytes for b in s.blocks)
    assert all(b.h2d_gbps > 0 for b in s.blocks if b.fetches)
    assert sum(b.resident_bytes for b in s.blocks) == s.resident_bytes
    assert all(b.peak_resident_bytes == b.nbytes for b in s.blocks)  # each was resident at some point
    assert "GB/s in" in text and "peak" in text


def test_reset_zeroes_counters_but_not_sizes():
    model = cyclic()
    pager.wrap(model, budget=3 * tensor_page_bytes(model[0]), device="cpu")
    with torch.no_grad():
        model(torch.randn(2, 64))
    pg = pager.of(model)
    pg.reset()
    s = pg.stats()
    assert (s.hits, s.misses, s.h2d_bytes, s.evictions, s.steps) == (0, 0, 0, 0, 0)
    assert s.budget_bytes == pg.budget_bytes and all(b.nbytes > 0 for b in s.blocks)
    assert s.peak_resident_bytes == s.resident_bytes


def test_trace_is_chrome_json_with_every_block(tmp_path):
    model = cyclic()
    pager.wrap(model, budget=3 * tensor_page_bytes(model[0]), device="cpu", trace_steps=2)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 64))
    path = pager.of(model).trace(str(tmp_path / "trace.json"))
    data = json.load(open(path))
    events = [e for e in data["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in events}
    for i in range(6):
        assert f"compute[{i}]" in names
        assert f"fetch[{i}]" in names or i == 0  # block 0 stays resident (the kept set)
    for e in events:
        assert e["dur"] >= 0 and e["ts"] >= 0 and e["cat"] in ("fetch", "compute", "writeback", "wait")
    tracks = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M"}
    assert {"h2d stream", "compute stream"} <= tracks


def test_trace_is_off_until_started(tmp_path):
    model = cyclic()
    pager.wrap(model, budget=3 * tensor_page_bytes(model[0]), device="cpu")
    with pytest.raises(RuntimeError, match="tracing is off.*start_trace"):
        pager.of(model).trace(str(tmp_path / "t.json"))
    pager.of(model).start_trace(steps=1)
    with torch.no_grad():
        model(torch.randn(2, 64))
        model(torch.randn(2, 64))
    events = json.load(open(pager.of(model).trace(str(tmp_path / "t.json"))))["traceEvents"]
    computes = [e for e in events if e.get("cat") == "compute"]
    assert len(computes) == 6  # one step kept: each block once


def test_profiler_ranges_name_the_block():
    model = cyclic()
    pager.wrap(model, budget=3 * tensor_page_bytes(model[0]), device="cpu")
    with torch.profiler.profile() as prof, torch.no_grad():
        model(torch.randn(2, 64))
    names = {e.name for e in prof.events()}
    assert "pager::fetch[3]" in names and any(n.startswith("pager::evict[") for n in names)


@pytest.mark.parametrize("blocks_budget", [2, 3, 4, 6])
def test_plan_matches_what_a_run_does(blocks_budget):
    model = cyclic()
    budget = blocks_budget * tensor_page_bytes(model[0])
    p = pager.plan(model, budget, device="cpu")
    assert p.runs and p.fits_all == (blocks_budget == 6)
    pager.wrap(model, budget=budget, device="cpu")
    pg = pager.of(model)
    with torch.no_grad():
        model(torch.randn(2, 64))
        model(torch.randn(2, 64))
        pg.reset()
        model(torch.randn(2, 64))
    assert pg.stats().h2d_bytes == p.forward_bytes
    assert {b.name for b in pg.scheduler.kept} == set(p.kept)
    assert pg.min_budget_bytes == p.min_budget_bytes
    assert f"{1e3 * p.forward_floor_seconds:.1f} ms" in str(p)


def test_plan_of_a_training_step_counts_where_updates_run():
    """A step's bytes under the default placement (updates of streamed blocks
    on the host: weights up twice, gradients down) and with every update on
    the device; the plan's saving in what a step moves in as the run's, within
    0.15 of the device placement's bytes."""
    moved = {}
    for placement in ("auto", "device"):
        model = cyclic(n=8)
        budget = 3 * 4 * tensor_page_bytes(model[0])  # about 3 blocks with gradients and AdamW state
        # (defer_step=False: every update done within step(), so that what moves does not
        # depend on how far the host's updates got when the forward came)
        p = pager.plan(model, budget, device="cpu", optimizer_step=placement, defer_step=False)
        pager.wrap(model, budget=budget, device="cpu", optimizer_step=placement, defer_step=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        pg = pager.of(model)
        torch.manual_seed(0)
        for i in range(5):
            if i == 4:
                pg.reset()
            model(torch.randn(2, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        s = pg.stats()
        moved[placement] = (p.train_h2d_bytes, p.train_d2h_bytes, s.h2d_bytes, s.d2h_bytes, s.host_steps)
        pager.unwrap(model)
    (plan_in, plan_out, run_in, run_out, host_steps), device = moved["auto"], moved["device"]
    assert host_steps > 0 and device[4] == 0
    assert plan_in < device[0] and plan_out < device[1] and run_in < device[2] and run_out < device[3]
    # (an estimate: which blocks the scheduler keeps varies from run to run)
    assert abs(plan_in / device[0] - run_in / device[2]) <= 0.15, moved
    with pytest.raises(ValueError, match="optimizer_step='cpu'"):
        pager.plan(cyclic(), "1MiB", device="cpu", optimizer_step="cpu")


def test_plan_of_a_tied_decoder_and_too_small_a_budget():
    model = TinyLM()
    p = pager.plan(model, "1MiB", device="cpu")
    assert [n for n, _ in p.blocks] == [f"layers.{i}" for i in range(6)]
    assert p.remainder_bytes == tensor_page_bytes(model.embed) + tensor_page_bytes(model.norm)
    small = pager.plan(model, p.min_budget_bytes - 1, device="cpu")
    assert not small.runs and "WILL NOT RUN" in str(small)
    assert "no paging needed" in str(pager.plan(model, "1GiB", device="cpu"))
    assert all(not m._forward_pre_hooks for m in model.modules())  # nothing changed


def test_plan_command_line(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import torch.nn as nn\ndef build():\n    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])\n"
    )
    run = lambda budget, *more, factory="mymodels:build": subprocess.run(  # noqa: E731
        [sys.executable, "-m", "pager", "plan", factory, "--budget", budget, "--device", "cpu", *more],
        cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])},
    )
    ok = run("40KiB")
    assert ok.returncode == 0, ok.stderr
    assert "per forward" in ok.stdout and "streams" in ok.stdout
    bad = run("1KiB")
    assert bad.returncode == 1 and "WILL NOT RUN" in bad.stdout
    assert "ACTIVATIONS NOT COUNTED" in ok.stdout and "least budget that trains" not in ok.stdout
    batch = run("40KiB", "--inputs", "32x64")  # 6 Linear blocks each save their 32x64 fp32 input
    assert batch.returncode == 1, batch.stderr  # (a training step is planned: it runs, it does not train)
    assert "saves 48.00 KiB for its backward" in batch.stdout and "activations=recompute:" in batch.stdout
    assert "WILL NOT TRAIN" in batch.stdout
    trains = run("1MiB", "--inputs", "32x64")
    assert trains.returncode == 0 and "least budget that trains" in trains.stdout, trains.stderr
    wrong = run("40KiB", "--inputs", "32x64:float99")
    assert wrong.returncode == 2 and "'float99' is not a torch dtype" in wrong.stderr
    (tmp_path / "mybf16.py").write_text(
        "import torch, torch.nn as nn\ndef build():\n"
        "    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).to(torch.bfloat16)\n")
    bf16 = [run("40KiB", *more, factory="mybf16:build").stdout for more in ([], ["--master-weights"])]
    assert "WILL NOT TRAIN" not in bf16[0] and "WILL NOT TRAIN" in bf16[1]  # (float32 state and masters counted)


# ------------------------------------------------------------------ warnings
def _warnings(caplog, key):
    return [r for r in caplog.records if r.levelno == logging.WARNING and key in r.getMessage()]


@pytest.mark.parametrize("budget_blocks,fires", [(8, True), (3, False)])
@pytest.mark.parametrize("first", ["inference", "training"])
def test_warns_when_the_model_fits_the_budget(caplog, budget_blocks, fires, first):
    """Said once, at the first forward, where the user can act: inference
    needs no paging. A training forward (gradients and optimizer state may
    still page) is not warned."""
    caplog.set_level(logging.WARNING, logger="pager")
    model = cyclic()
    pager.wrap(model, budget=budget_blocks * tensor_page_bytes(model[0]), device="cpu")
    assert not _warnings(caplog, "fits the budget")  # (not at wrap: nothing says yet what the model is for)
    x = torch.randn(4, model[0].in_features)
    with torch.set_grad_enabled(first == "training"):
        model(x)
    with torch.no_grad():
        model(x)  # (a later inference forward says nothing more)
    assert len(_warnings(caplog, "fits the budget")) == (1 if fires and first == "inference" else 0)


@pytest.mark.parametrize("threshold,fires", [(1, True), (1 << 40, False)])
def test_says_when_wrap_will_take_a_while(caplog, monkeypatch, threshold, fires):
    import pager.api.checks as api  # (what wrap says before paging)

    caplog.set_level(logging.WARNING, logger="pager")
    monkeypatch.setattr(api, "PIN_PROGRESS_BYTES", threshold)
    pager.wrap(cyclic(), budget="1GiB", device="cpu")
    found = _warnings(caplog, "host pages for 6 blocks; wrap takes about")
    assert len(found) == (1 if fires else 0)


class Skips(nn.Module):
    """Layer 2 never runs."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i != 2:
                x = layer(x)
        return x


@pytest.mark.parametrize("model_cls,fires", [(Skips, True), (lambda: cyclic(4, 16), False)])
def test_warns_once_when_a_block_never_runs(caplog, model_cls, fires):
    caplog.set_level(logging.WARNING, logger="pager")
    model = model_cls()
    pager.wrap(model, budget=1 << 20, device="cpu")
    with torch.no_grad():
        for _ in range(25):
            model(torch.randn(2, 16))
    found = _warnings(caplog, "never ran")
    assert len(found) == (1 if fires else 0)
    if fires:
        assert "layers.2" in found[0].getMessage()


class Alternates(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(6))
        self.flip = False

    def forward(self, x):
        order = reversed(self.layers) if self.flip else self.layers
        for layer in order:
            x = layer(x)
        return x


@pytest.mark.parametrize("say_it", [False, True])
def test_warns_when_the_order_changes_unless_expected(caplog, say_it):
    caplog.set_level(logging.WARNING, logger="pager")
    model = Alternates()
    pager.wrap(model, budget=3 * tensor_page_bytes(model.layers[0]), device="cpu")
    with torch.no_grad():
        for step in range(6):
            model.flip = bool(step % 2)
            if say_it:
                order = list(reversed(model.layers)) if model.flip else list(model.layers)
                pager.of(model).expect(order)
            model(torch.randn(2, 16))
    assert len(_warnings(caplog, "order of blocks changed")) == (0 if say_it else 1)


def test_a_single_change_of_order_does_not_warn(caplog):
    # The first training step often differs from the rest (optimizer state is
    # created in it): one change is not a pattern worth a warning.
    caplog.set_level(logging.WARNING, logger="pager")
    model = Alternates()
    pager.wrap(model, budget=3 * tensor_page_bytes(model.layers[0]), device="cpu")
    with torch.no_grad():
        for step in range(6):
            model.flip = step == 0
            model(torch.randn(2, 16))
    assert pager.of(model).stats().order_changes == 1
    assert not _warnings(caplog, "order of blocks changed")


@pytest.mark.parametrize("flips", [False, True])
def test_the_first_update_under_accumulation_is_no_change_of_order(caplog, flips):
    # Two passes a step: the first update's uses (its optimizer state made)
    # end the second pass's recording, and no later update fetches a block
    # (the biases' state is tiny and stays): the order changes twice, once
    # each way, around the first update, which the user cannot act on. An
    # order that flips at every pass is still a pattern worth the warning.
    caplog.set_level(logging.WARNING, logger="pager")
    torch.manual_seed(0)
    model = Alternates(d=64)
    for layer in model.layers:
        layer.weight.requires_grad_(False)
    pager.wrap(model, budget=2 * tensor_page_bytes(model.layers[0]), device="cpu")
    opt = torch.optim.AdamW([layer.bias for layer in model.layers], lr=1e-3)
    passes = 0
    for _step in range(5):
        for _micro in range(2):
            model.flip = flips and passes % 2 == 1
            model(torch.randn(4, 64)).square().mean().backward()
            passes += 1
        opt.step()
        opt.zero_grad()
    assert pager.of(model).stats().order_changes >= 2
    assert len(_warnings(caplog, "order of blocks changed")) == (1 if flips else 0)


class Light(nn.Module):
    """Blocks with no arithmetic: a step is all copying when they stream."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Payload() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _Payload(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("big", torch.randn(1 << 14))

    def forward(self, x):
        return x + 1


@pytest.mark.parametrize("budget_blocks,fires", [(1, True), (8, False)])
def test_warns_when_stalls_dominate(caplog, budget_blocks, fires):
    """A slow link (10 ms per copy, inside the timed copy) and one block of
    room: compute waits on every fetch. With room for all, nothing moves
    after the first step and nothing is said."""
    caplog.set_level(logging.WARNING, logger="pager")
    model = Light()
    pager.wrap(model, budget=budget_blocks * tensor_page_bytes(model.layers[0]), device="cpu", prefetch=0)
    transport = pager.of(model).transport

    def slow_h2d(device_flat, host, after=(), seg=None):
        t0 = time.perf_counter()
        time.sleep(0.01)
        device_flat.copy_(host)
        return t0, time.perf_counter()

    transport.h2d = slow_h2d
    with torch.no_grad():
        for _ in range(22):
            model(torch.zeros(1))
    assert len(_warnings(caplog, "waited for transfers")) == (1 if fires else 0)


def test_stats_is_a_snapshot():
    model = TinyLM()
    pager.wrap(model, budget=3 * tensor_page_bytes(model.layers[0]), device="cpu")
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        model(ids)
        before = pager.of(model).stats()
        hits, moved = before.hits + before.misses, before.h2d_bytes
        model(ids)
    assert (before.hits + before.misses, before.h2d_bytes) == (hits, moved)
    after = pager.of(model).stats()
    assert after.hits + after.misses > hits and after.h2d_bytes > moved
