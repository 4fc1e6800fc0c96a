"""activations="offload": what blocks' training forwards save goes to host
memory and comes back for the backward ([Note: activations off the device]
in training/offload.py); activations="recompute": it is dropped and each block's
forward runs again in its backward ([Note: activations recomputed]). CPU
device, bit for bit against the model trained unwrapped; every test checks
that activations did leave (or were recomputed), so none can pass with the
policy doing nothing."""

import copy
import gc
import logging
import random
import time
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pager
from pager.base.budget import format_bytes
from pager.model import step_needs
from pager.training import activations as activations_module
from pager.training import offload as offload_module
from helpers import assert_models_equal, assert_same, hooked_blocks, tensor_page_bytes
from models import SuperNet, TinyLM
from test_training import batches, regime_budget, torch_clip, train


LM_BATCH = torch.zeros(2, 8, dtype=torch.long)  # (the shape of test_training's batches)


def offloading(model, budget, policy="offload", inputs=None, **kwargs):
    """Wrap `model` under `policy`, activations of any size offloaded; with
    `inputs` (a batch), the budget is `budget` for blocks plus what
    activations hold under `policy` in a training pass with it (its
    prediction: [Note: what each policy holds, predicted]). The budget is
    pager's alone unless `budget_covers` says otherwise: these tests size it
    for blocks and activations (what the process holds beside them:
    test_outside.py)."""
    if inputs is not None:
        budget += activations_room(model, inputs, policy)
    kwargs.setdefault("budget_covers", "pager")
    pager.wrap(model, budget=budget, device="cpu", activations=policy, **kwargs)
    pager.of(model).activations.offload.min_bytes = 0  # these models' activations are a few KiB
    return pager.of(model)


def activations_room(model, inputs, policy="auto", min_bytes=0, copies=False):
    """What activations hold at most under `policy` ("auto": the most of
    any it may choose) in a training pass of `model` on `inputs`, offloading
    activations of `min_bytes` and more (`offloading`'s: any size), their
    copies out holding device memory (`copies`: CUDA) or not (the CPU device)."""
    saved = pager.plan(model, "100%", device="cpu", inputs=inputs).saved
    policies = [policy] if policy != "auto" else ["offload, views kept", "offload", "recompute"]
    return max(saved.peak(p, min_bytes=min_bytes, copies=copies) for p in policies)


def assert_acted(p, policy, backwards=1):
    """The policy did its work: activations left and came back (each once per
    backward), or blocks' forwards ran again in the backward."""
    s = p.stats()
    if policy == "auto":
        policy = s.activations_policy  # (chosen before the first pass, from the measure on fake tensors)
        assert policy in ("offload", "recompute")
    if policy == "offload":
        assert s.activations_sent_bytes > 0 and s.recomputes == 0
        # (each comes back once a backward: copied in, or used where it still was)
        assert s.activations_brought_bytes + s.activations_reused_bytes == backwards * s.activations_sent_bytes
    if policy == "recompute":
        assert s.recomputes > 0 and s.activations_recomputed_bytes > 0 and s.activations_sent_bytes == 0


@pytest.mark.parametrize("policy", ["offload", "recompute", "auto"])
@pytest.mark.parametrize("regime", ["fits", "streams"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_training_with_activations_paged_matches_unwrapped(policy, regime, autocast):
    model = TinyLM()
    ref = copy.deepcopy(model)
    p = offloading(model, regime_budget(model, regime), policy, inputs=LM_BATCH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(6)
    train(model, opt, data, clip=torch_clip, autocast=autocast)  # with accumulation
    train(ref, ref_opt, data, clip=torch_clip, autocast=autocast)
    s = p.stats()
    if policy == "auto" and regime == "fits":
        # Room beyond the blocks for all of it: every block keeps its activations
        # once they are measured (the first pass sent them out).
        assert s.activations_policy == "keep" and s.activations_kept_blocks == len(p.activations.offload.order) > 0
        assert s.recomputes == 0
        pager.unwrap(model)
        assert_models_equal(model, ref)
        return
    assert_acted(p, policy)
    if policy != "recompute":
        assert s.activations_ahead_bytes > 0  # brought at the block's pre-backward, before autograd asked
    if policy == "recompute":
        # Every layer but the last (its activations stay: the backward needs them
        # first, known from the first pass on by the measure on fake tensors) ran
        # again in each of the 9 backwards.
        assert s.recomputes == 9 * (len(model.layers) - 1)
    pager.unwrap(model)
    assert_models_equal(model, ref)



class _Pending:
    """The event of a copy out that has not completed (on the CPU device a
    copy is done when it returns; on a GPU the link may still carry it)."""

    def query(self):
        return False


def copies_out_pending(p, monkeypatch, cap_bytes):
    """Copies out stay under way until more than `cap_bytes` (or a block's
    activations, if more) are, as on a GPU whose link lags the forward."""
    send = p.transport.send_to_host
    monkeypatch.setattr(p.transport, "send_to_host", lambda t, host=None: (send(t, host)[0], _Pending()))
    monkeypatch.setattr(offload_module, "IN_FLIGHT_MIN_BYTES", cap_bytes)


@pytest.mark.parametrize("cap_bytes", [0, 1 << 40])
def test_activations_still_on_the_device_are_used_there(monkeypatch, cap_bytes):
    """An activation whose device memory is still held for its copy out when
    the backward asks for it is used where it is, not copied back ([Note:
    activations off the device]): with the copies out lagging by about a
    block (cap 0) the last blocks' are reused and the others brought; with
    none done, all are. Bit for bit equal to the unwrapped model either way."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    p = offloading(model, regime_budget(model, "streams"), inputs=LM_BATCH)
    copies_out_pending(p, monkeypatch, cap_bytes)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(6)
    train(model, opt, data, clip=torch_clip)
    train(ref, ref_opt, data, clip=torch_clip)
    s = p.stats()
    assert_acted(p, "offload")
    assert s.activations_reused_bytes > 0
    assert (s.activations_brought_bytes > 0) == (cap_bytes == 0)
    assert p.activations.ledger.flight == 0 and not p.activations.offload._in_flight  # (each let go at its pass's end)
    pager.unwrap(model)
    assert_models_equal(model, ref)


class ShiftsWhatItSaved(nn.Module):
    """A ReLU block (the ReLU saves its output) that shifts that output in
    place once it has used it, or does not."""

    def __init__(self, d, in_place):
        super().__init__()
        self.lin, self.in_place = nn.Linear(d, d), in_place

    def forward(self, x):
        h = torch.relu(self.lin(x))
        out = h * 2
        if self.in_place:
            h.sub_(0.25)
        return out


def test_an_activation_changed_in_place_after_its_save_is_not_used_where_it_is(monkeypatch):
    """A saved activation changed in place since its save (unwrapped, autograd
    would refuse the backward) is copied back as it was saved ([Note:
    activations off the device]), not used as it is on the device: the same
    gradients as a model that does not change it."""
    torch.manual_seed(0)
    model = nn.Module()
    # (not the last block: its activations stay on the device, where pager's
    # hooks refuse a change in place as autograd does)
    model.layers = nn.Sequential(*(ShiftsWhatItSaved(16, in_place=i < 5) for i in range(6)))
    model.forward = model.layers.forward
    ref = copy.deepcopy(model)
    for block in ref.layers:
        block.in_place = False
    p = offloading(model, regime_budget(model, "streams"), inputs=torch.zeros(64, 16))
    copies_out_pending(p, monkeypatch, 1 << 40)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x.clone()).sum().backward()
            o.step()
            o.zero_grad()
    s = p.stats()
    assert s.activations_reused_bytes > 0  # (the linears' inputs, unchanged)
    assert s.activations_brought_bytes > 0  # (the ReLUs' outputs, shifted since)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_the_ledger_counts_copies_out_as_full_only_while_a_forward_may_send():
    """A pass's peak counts the queue of copies out as full while the forward
    sends (the next pass's timing may fill it); once the backward has begun it
    only drains, and what it holds counts as it is ([Note: one budget])."""
    ledger = activations_module.Ledger(torch.device("cpu"))
    ledger.flight_cap = 100
    ledger.add(10, flight=10)
    assert ledger.pass_peak == 100  # (10 in flight, counted as the cap)
    ledger.sending = False  # (the backward began)
    ledger.add(50)
    assert ledger.pass_peak == 100 and ledger.live == 60  # 60 counted as they are, not 150
    ledger.sub(0, flight=10)  # (what was in flight is held for the backward now)
    ledger.add(60)
    assert ledger.pass_peak == 120
    ledger.pass_ends()
    assert ledger.sending and ledger.last_pass_peak == 120

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


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_views_outputs_and_dropout_masks(policy):
    """Recomputed, a block draws the same dropout mask as in its forward, and
    the global RNG goes on as if nothing had run again."""
    torch.manual_seed(0)
    model = nn.Sequential(*[SavesViews() for _ in range(5)])
    ref = copy.deepcopy(model)
    one = sum(t.numel() * t.element_size() for t in model[0].state_dict().values())
    p = offloading(model, 4 * one + 4096, policy)
    for step in range(2):  # the second knows the last block (its activations stay)
        x = torch.randn(6, 32, requires_grad=True)
        rx = x.detach().clone().requires_grad_(True)
        torch.manual_seed(1 + step)
        model(x).pow(2).sum().backward()
        after = torch.rand(3)
        torch.manual_seed(1 + step)
        ref(rx).pow(2).sum().backward()
        assert_same(after, torch.rand(3))
        assert_same(x.grad, rx.grad)
        for a, b in zip(model.parameters(), ref.parameters()):
            assert_same(a.grad, b.grad)
    assert_acted(p, policy)


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_batchnorm_running_statistics_count_each_batch_once(policy):
    """[Note: buffers a forward changes]: a recomputed block's BatchNorm
    leaves its running statistics and its batch count as the forward left
    them, so they equal the unwrapped model's (and so does evaluation)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU()) for _ in range(6)])
    ref = copy.deepcopy(model)
    one = sum(t.numel() * t.element_size() for t in model[0].state_dict().values())
    p = offloading(model, 12 * one + 4096, policy)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    for _ in range(4):
        x = torch.randn(16, 32)
        for m, opt in zip((model, ref), opts):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert_acted(p, policy)
    assert_models_equal(model, ref)  # (buffers too: running_mean, running_var, num_batches_tracked)
    for m in (model, ref):
        m.eval()
    x = torch.randn(8, 32)
    with torch.no_grad():
        assert_same(model(x), ref(x))


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_a_graph_kept_for_a_second_backward(policy):
    model = TinyLM()
    ref = copy.deepcopy(model)
    p = offloading(model, regime_budget(model, "streams"), policy, inputs=LM_BATCH)
    ids = batches(1)[0][0]
    for m in (model, ref):
        out = m(ids).float().pow(2).mean()
        out.backward(retain_graph=True)  # a second backward brings (or recomputes) the activations again
        out.backward()
    assert_acted(p, policy, backwards=2)
    if policy == "recompute":  # (all but the last block, known from the measure before the first pass)
        assert p.stats().recomputes == 2 * (len(model.layers) - 1)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert_same(a.grad, b.grad)


def test_a_graph_dropped_unused_takes_its_host_copies():
    model = TinyLM()
    p = offloading(model, regime_budget(model, "streams"), inputs=LM_BATCH)
    ids = batches(1)[0][0]
    model(ids).sum().backward()
    s = p.stats()
    sent = s.activations_sent_bytes
    out = model(ids)  # a graph no backward comes for: its host copies go with it
    assert p.stats().activations_sent_bytes > sent
    copies = [r for _block, refs, _bytes in p.activations.offload._groups for r in refs]
    assert copies and all(r() is not None for r in copies)
    del out
    gc.collect()
    assert all(r() is None for r in copies)
    model(ids).sum().backward()
    assert not p.activations.offload._groups  # forgotten, and this step's were each reached by its backward


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_no_grad_forwards_and_the_keep_policy_send_nothing(policy):
    model = TinyLM()
    p = offloading(model, regime_budget(model, "streams"), policy, inputs=LM_BATCH)
    with torch.no_grad():
        model(batches(1)[0][0])
    assert p.stats().activations_sent_bytes == 0 and p.stats().recomputes == 0
    kept = TinyLM()
    pager.wrap(kept, budget=regime_budget(kept, "streams"), device="cpu", activations="keep")
    kept(batches(1)[0][0]).sum().backward()
    assert pager.of(kept).activations is None and pager.of(kept).stats().activations_sent_bytes == 0


def test_an_unknown_policy_is_refused_before_anything_changes():
    model = TinyLM()
    before = [t.clone() for t in model.state_dict().values()]
    with pytest.raises(ValueError, match="activations='gpu'.*keep.*offload.*recompute.*auto"):
        pager.wrap(model, budget="1GiB", device="cpu", activations="gpu")
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
    with pytest.raises(ValueError, match="not wrapped"):
        pager.of(model)


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_user_saved_tensor_hooks_win(policy):
    """Inside the user's own saved-tensor hooks (here save_on_cpu's), pager's
    stand aside: the user's policy applies, and nothing is offloaded twice."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    p = offloading(model, regime_budget(model, "streams"), policy, inputs=LM_BATCH)
    ids = batches(1)[0][0]
    for m in (model, ref):
        with torch.autograd.graph.save_on_cpu():
            m(ids).pow(2).sum().backward()
    assert p.stats().activations_sent_bytes == 0 and p.stats().recomputes == 0
    for a, b in zip(model.parameters(), ref.parameters()):
        assert_same(a.grad, b.grad)


def test_the_last_blocks_activations_stay_on_the_device():
    """The backward needs the last block's activations first: from the second
    forward on (the order is known), they are not sent out and straight back."""
    model = TinyLM()
    p = offloading(model, regime_budget(model, "streams"), inputs=LM_BATCH)
    ids = batches(1)[0][0]
    block_of = {b.module: b for b in p.blocks}
    model(ids).sum().backward()
    out = model(ids)
    sent_for = [g[0] for g in p.activations.offload._groups]
    assert block_of[model.layers[4]] in sent_for and block_of[model.layers[5]] not in sent_for
    out.sum().backward()


class Wide(nn.Module):
    """A block whose intermediate (4x wider) is saved for its backward."""

    def __init__(self, d=32):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


def streams(model):
    """A budget for about 2.5 of the Sequential's blocks with their grads and Adam state."""
    return int(2.5 * 4 * tensor_page_bytes(model[0]))


def test_recomputed_blocks_hold_only_their_inputs_between_forward_and_backward():
    """What a recomputed block's forward saved is gone once the forward has
    moved on (the last block's stays: its backward comes first)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide() for _ in range(4)])
    ref = copy.deepcopy(model)
    p = offloading(model, streams(model), "recompute")
    wides = []
    for layer in model:
        # The memory, not the tensor object: autograd may hold an alias of it.
        layer.act.register_forward_hook(lambda m, a, out: wides.append(weakref.ref(out.untyped_storage())))
    x = torch.randn(8, 32)
    model(x).sum().backward()  # (the last block is known from the first pass on: measured before it)
    wides.clear()
    out = model(x)
    gc.collect()
    assert [r() is not None for r in wides] == [False, False, False, True]
    out.sum().backward()
    for _ in range(2):
        ref(x).sum().backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert_same(a.grad, b.grad)
    assert p.stats().recomputes == 3 + 3


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "to-the-end"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_layers_split_into_parts_recompute_them_with_their_own_saves(policy, early_stop, monkeypatch):
    """A layer split into parts (its Linears blocks of their own inside it):
    under recompute the parts' saves are dropped for the layer's
    recomputation ([Note: blocks inside a recomputed block]), which runs
    the parts again, their saves matched by number ([Note: saves counted
    across nested blocks]): one recomputation a layer. Also run to the
    forward's end, as under torch's CUDA sanitizer ([Note: activations
    recomputed])."""
    from pager.training import recompute as _saved
    monkeypatch.setattr(_saved, "_cuda_trace_hooks_on", lambda: not early_stop)
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide(256) for _ in range(12)])  # parts of 1 MiB and more get blocks of their own
    ref = copy.deepcopy(model)
    p = offloading(model, streams(model), policy, inputs=torch.zeros(32, 256))
    assert {"1", "1.up", "1.down"} <= {b.name for b in p.blocks}, [b.name for b in p.blocks]  # parts inside the layer
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        x = torch.randn(32, 256, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    assert_acted(p, policy)
    if p.stats().activations_policy == "recompute":  # (the last layer's too: its last part keeps its own)
        assert p.stats().recomputes == 10 * 12
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_the_faster_policy_by_its_predicted_pass():
    """On a CUDA device "auto" takes the policies in the order of a pass's
    predicted seconds ([Note: the faster policy, predicted]): the FLOPs of
    each block's forward are counted on fake tensors, and its backward's
    from which operands need a gradient; where the link bounds the pass
    (its pages stream), recompute comes first; where compute does,
    offloading; without speeds (the CPU device), the order stands."""
    from pager.training.dry_run import measure_saved
    from pager.training.saved_bytes import Speeds, choose

    model = nn.Sequential(*[Wide(256) for _ in range(6)])
    named = [(str(i), m) for i, m in enumerate(model)]
    f = 2 * (2 * 512 * 256 * 1024)  # (a block's up and down)
    sb = measure_saved(model, named, (torch.zeros(512, 256),))
    assert sb.flops == [f] * 6 and sb.outside_flops == 0
    assert sb.flops_dtype == torch.float32 and sb.within == [-1] * 6
    # Backward: the first block's up computes its weight's gradient alone (its input needs none), the rest two.
    assert sb.backward_flops == [f // 2 + f] + [2 * f] * 5
    kw = {"min_bytes": 0, "copies": False}
    spare = -sum(sb.saved)  # (the pages do not fit: they stream)
    link_bound, compute_bound = Speeds(1e9, 1e15), Speeds(1e15, 1e9)
    for speeds, first in ((link_bound, "recompute"), (compute_bound, "offload, views kept"), (None, "offload, views kept")):
        kept, policy, _held = choose(sb, "auto", spare, None, speeds, **kw)
        assert (kept, policy) == (set(), first)
    seconds = sb.predicted_seconds("recompute", (), 0, 0, compute_bound)
    assert seconds == pytest.approx((6 * f + sb.backward_flops[0] + 10 * f + 5 * f) / 1e9)  # (the last keeps its own)
    # Frozen weights, an input that needs a gradient (LoRA's base layers): the backward computes the inputs' alone.
    model.requires_grad_(False)
    frozen = measure_saved(model, named, (torch.zeros(512, 256, requires_grad=True),))
    assert frozen.backward_flops == frozen.flops == [f] * 6


def test_an_input_changed_in_place_before_its_recomputation_is_an_error():
    model = nn.Sequential(*[Wide() for _ in range(3)])
    offloading(model, streams(model), "recompute")
    x = torch.randn(8, 32, requires_grad=True)
    h = x * 1.0
    out = model(h)
    with torch.no_grad():
        h.mul_(2.0)  # the first block's input
    with pytest.raises(RuntimeError, match=r"input of block '0'.*changed in place.*clone"):
        out.sum().backward()


class SavesOtherTensors(nn.Module):
    """Saves a narrower slice on every second call: not the same when run again."""

    def __init__(self, d=32):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.lin(x)
        if self.calls % 2:
            return x + torch.tanh(y)
        return x + torch.cat([torch.tanh(y[:, :16]), y[:, 16:]], 1)


def test_a_block_that_saves_other_tensors_when_run_again_is_an_error():
    model = nn.Sequential(*[SavesOtherTensors() for _ in range(3)])
    offloading(model, streams(model), "recompute")
    out = model(torch.randn(8, 32))
    with pytest.raises(RuntimeError, match=r"block '\d'.*saved a tensor of shape.*when run again.*offload"):
        out.sum().backward()


class SlowAgain(nn.Module):
    """A layer that is slow only when run again for its backward (with `slow`)."""

    def __init__(self, d=32, slow=True):
        super().__init__()
        self.lin, self.slow = nn.Linear(d, d), slow

    def forward(self, x):
        if self.slow and pager.training.recompute.recomputing():
            time.sleep(0.02)
        return torch.tanh(self.lin(x))


def no_room_to_keep(p):
    """No optimizer state here, so every block fits the budget beside its
    gradients, and "auto" would keep the activations: make it try the two."""
    p.activations.spare_bytes = lambda: 0


class Transposes(nn.Module):
    """Saves a transposed view (dense, not contiguous) twice, as attention's
    q, k and v are: `offload` sends them, its views-kept variant keeps them."""

    def __init__(self, d=32):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.scale = nn.Parameter(torch.ones(4 * d, 1))

    def forward(self, x):
        return x + self.down((self.up(x).t() * self.scale).t())


@pytest.mark.parametrize("room", ["views kept", "offload", "recompute", "none"])
def test_auto_chooses_before_the_first_pass_what_the_budget_holds(room):
    """[Note: activations, the automatic choice]: "auto" measures the forward
    on fake tensors before the first pass and takes the first of offload
    with views kept, offload and recompute whose prediction the budget holds
    beside what blocks need at least; it runs no pass under another, and
    from the first step on blocks and activations stay within the budget.
    Where none holds, the first forward is refused before it runs (nothing
    changed), naming the least budget that holds, which then trains."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Transposes() for _ in range(6)])
    ref = copy.deepcopy(model)
    x0 = torch.zeros(256, 32)
    held = {p: activations_room(model, x0, p) for p in ("offload, views kept", "offload", "recompute")}
    assert held["recompute"] < held["offload"] < held["offload, views kept"]  # (so each budget picks one)
    probe = copy.deepcopy(model)
    pager.wrap(probe, budget=1 << 30, device="cpu", optimizer=torch.optim.Adam(probe.parameters(), lr=1e-2))
    least = step_needs.least_bytes(pager.of(probe))  # blocks with gradients and Adam's state, the attached optimizer's
    pager.unwrap(probe)
    budget = least + {"views kept": held["offload, views kept"], "none": held["recompute"] - 1}.get(room, held.get(room))
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    p = offloading(model, budget, "auto", optimizer=opt)
    p.activations.spare_bytes = lambda: 0  # (no room beyond every block: none keeps its own)
    before = copy.deepcopy(model.state_dict())
    if room == "none":
        with pytest.raises(pager.BudgetError, match=rf"budget of at least {format_bytes(least + held['recompute'], up=True)}"):
            wide_steps(model, opt, 1)
        assert_same_state(model.state_dict(), before) and all(q.grad is None for q in model.parameters())
        p.set_budget(least + held["recompute"])  # the budget it names trains
    for step in range(4):
        p.reset()
        wide_steps(model, opt, 1, seed=step)
        s = p.stats()
        assert s.peak_device_bytes <= p.budget_bytes, (step, s.peak_device_bytes, p.budget_bytes)
        expected = "offload" if room in ("views kept", "offload") else "recompute"
        assert s.activations_policy == expected and p.activations.offload.views == (room != "views kept")
        assert (s.recomputes > 0) == (expected == "recompute") and (s.activations_sent_bytes > 0) != (s.recomputes > 0)
    for step in range(4):
        wide_steps(ref, ref_opt, 1, seed=step)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_auto_never_runs_the_policy_that_breaks_the_budget(caplog):
    """Offload keeps activations under its threshold on the device, which
    on this small Llama holds more than the budget has room for: "auto"
    chooses recompute before the first pass, and blocks and activations stay
    within the budget from the first step (measured before, "auto" ran two
    passes under each policy and kept the peak its trials had made)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=4, use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    budget = int(0.6 * 4 * tensor_page_bytes(model))  # of weights, gradients and AdamW state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pager.wrap(model, budget=budget, device="cpu", activations="auto", optimizer=opt)
    p = pager.of(model)
    ids = torch.randint(0, 256, (4, 32))
    with caplog.at_level(logging.INFO, logger="pager"):
        for _step in range(4):
            p.reset()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            s = p.stats()
            assert s.activations_policy == "recompute" and s.activations_sent_bytes == 0, s.activations_policy
            assert s.peak_device_bytes <= budget, (s.peak_device_bytes, budget)
    assert "recompute for the blocks that do not keep theirs" in caplog.text


def wide_steps(model, opt, steps, batch=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(batch, 32, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("policy", ["offload", "recompute", "auto"])
def test_blocks_and_activations_stay_within_the_budget_together(policy):
    """[Note: one budget]: from the second training pass on, blocks get the
    budget less what activations held in the last pass, so the two together
    never exceed it; values stay those of the unwrapped model."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide() for _ in range(6)])
    ref = copy.deepcopy(model)
    training_block = 4 * tensor_page_bytes(model[0])  # weights, grads, Adam's two states
    budget = int(7 * training_block)
    p = offloading(model, budget, policy)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    wide_steps(model, opt, 10)  # ("auto" has chosen after 9 passes)
    p.reset()
    wide_steps(model, opt, 3, seed=1)
    s = p.stats()
    assert s.activation_reserve_bytes > 0 and s.peak_activation_bytes > 0
    assert s.peak_device_bytes <= budget
    # Blocks gave the activations their room (it was not clamped to the least that runs).
    assert step_needs.least_room_bytes(p) <= budget - s.activation_reserve_bytes
    assert s.peak_resident_bytes <= budget - s.activation_reserve_bytes
    assert s.activation_bytes == 0  # every graph is gone: nothing is left counted
    wide_steps(ref, ref_opt, 10)
    wide_steps(ref, ref_opt, 3, seed=1)
    pager.unwrap(model)
    assert_models_equal(model, ref)


@pytest.mark.parametrize("room", ["all", "some", "none"])
def test_auto_keeps_the_activations_the_budget_has_room_for(room):
    """[Note: activations, the automatic choice]: beyond every block with its
    gradients and Adam's state, the budget's room keeps activations, the last
    blocks of the forward first; blocks never give up room for them (no
    evictions once measured), the rest is offloaded or recomputed, and the
    two together stay within the budget, with the values of the unwrapped model."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide() for _ in range(6)])
    ref = copy.deepcopy(model)
    probe = offloading(copy.deepcopy(model), 1 << 30, "auto")
    wide_steps(probe.model, torch.optim.Adam(probe.model.parameters(), lr=1e-2), 1)
    saved = max(probe.activations.saved_bytes.values())  # a block's activations, each storage once
    blocks = 6 * 4 * tensor_page_bytes(model[0])  # weights, grads, Adam's two states
    budget = {"all": 1 << 30, "some": blocks + 6 * saved, "none": blocks * 3 // 4}[room]
    p = offloading(model, budget, "auto")
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    wide_steps(model, opt, 8)  # (measured at the first pass; offload and recompute tried after)
    p.reset()
    wide_steps(model, opt, 3, seed=1)
    s = p.stats()
    order = p.activations.offload.order
    if room == "all":  # nothing moves, and no hooks run: as "keep"
        assert s.activations_policy == "keep" and s.activations_kept_blocks == 6
        assert s.activations_sent_bytes == s.recomputes == 0 and hooked_blocks(model) == 0
        assert s.peak_activation_bytes == 0  # (asleep: no saved-tensor hooks of pager's, nothing counted)
    elif room == "some":
        assert 1 < s.activations_kept_blocks < 6 and p.activations.kept == set(order[-s.activations_kept_blocks:])
        assert s.activations_policy in ("offload", "recompute")
        assert s.activations_sent_bytes > 0 or s.recomputes > 0
        assert s.evictions == 0 and s.peak_device_bytes <= budget
    else:
        assert s.activations_kept_blocks == 0 and s.evictions > 0 and s.peak_device_bytes <= budget
    wide_steps(ref, ref_opt, 8)
    wide_steps(ref, ref_opt, 3, seed=1)
    pager.unwrap(model)
    assert_models_equal(model, ref)


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_the_ledger_counts_a_storage_once_and_lets_go_when_the_graph_goes(policy):
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide() for _ in range(4)])
    p = offloading(model, 10 * 4 * tensor_page_bytes(model[0]), policy)
    ledger = p.activations.ledger
    x = torch.randn(64, 32)
    model(x).sum().backward()  # learns the order
    out = model(x)
    held = ledger.live
    # The last block keeps what it saved: its input (64x32), ReLU's output,
    # which `down` saves too (one storage, 64x128), and no more.
    assert held >= 4 * (64 * 32 + 64 * 128)
    del out
    gc.collect()
    assert ledger.live == 0  # the graph went without a backward
    model(x).sum().backward()
    assert ledger.live == 0 and ledger.last_pass_peak >= held


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_a_budget_no_policy_holds_is_refused_before_the_first_forward(policy):
    """A budget that activations crowd below what blocks need: the first
    training forward is refused before it runs (a `BudgetError` whose
    figures add up: blocks at least + activations = what a step holds), the
    model unchanged; the message names what holds (the other policy, or the
    least budget), and at that budget the steps train within it."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide() for _ in range(4)])
    ref = copy.deepcopy(model)
    x = torch.zeros(1024, 32)
    held = {p: activations_room(model, x, p) for p in ("offload", "recompute")}
    p = offloading(model, 3 * tensor_page_bytes(model[0]), policy)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-2) for m in (model, ref))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(pager.BudgetError) as refused:
        wide_steps(model, opt, 1, batch=1024)
    least = step_needs.least_bytes(p)
    text = str(refused.value)
    total, blocks, acts = (format_bytes(n) for n in (least + held[policy], least, held[policy]))
    assert f"holds at least {total} on the device: blocks at least {blocks}" in text and f"activations {acts}" in text
    need = least + min(held.values())
    assert f"a budget of at least {format_bytes(need, up=True)}" in text, text
    assert "torch.no_grad()" in text  # (an inference forward with gradients enabled is told what to do)
    assert_same_state(model.state_dict(), before) and all(q.grad is None for q in model.parameters())
    p.set_budget(need)
    if policy == "offload":  # (recompute holds least here)
        with pytest.raises(pager.BudgetError, match='activations="recompute", which holds this budget'):
            wide_steps(model, opt, 1, batch=1024)
        return
    for step in range(3):
        p.reset()
        wide_steps(model, opt, 1, batch=1024, seed=step)
        assert p.stats().peak_device_bytes <= need
        wide_steps(ref, ref_opt, 1, batch=1024, seed=step)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_the_chosen_policy_survives_a_reset():
    model = nn.Sequential(*[SlowAgain() for _ in range(4)])
    p = offloading(model, streams(model), "auto", inputs=torch.zeros(8, 32))
    no_room_to_keep(p)
    for _ in range(10):
        model(torch.randn(8, 32)).sum().backward()
    chosen = p.stats().activations_policy
    assert chosen in ("offload", "recompute")
    p.reset()
    assert p.stats().activations_policy == chosen


class _captured:
    """Messages logged on `name` while the body runs."""

    def __init__(self, name):
        self.logger, self.records = logging.getLogger(name), []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.records.append(record.getMessage())

    def __enter__(self):
        self.logger.addHandler(self.handler)
        return self.records

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_plan_predicts_what_activations_hold_in_a_training_step(policy):
    """`pager.plan(..., inputs=)` measures what each block's forward saves on
    fake tensors (nothing computed) and predicts, per policy, the most that
    activations hold: an upper bound of what the ledger then counts, and
    not a loose one."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide() for _ in range(6)])
    budget = int(7 * 4 * tensor_page_bytes(model[0]))
    x = torch.randn(256, 32)
    plan = pager.plan(model, budget, device="cpu", inputs=x)
    assert plan.saved.order == [str(i) for i in range(6)]
    # Each Wide saves its input (256x32) and ReLU's output (256x128, which `down` saves too: one storage).
    assert plan.saved.saved == [256 * (32 + 128) * 4] * 6 and plan.saved.inputs == [256 * 32 * 4] * 6
    assert plan.training_peaks[policy][0] == plan.saved.peak(policy, min_bytes=1 << 20, copies=False)
    predicted = plan.saved.peak(policy, min_bytes=0, copies=False)  # (as `offloading` sends them all)
    p = offloading(model, budget, policy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    wide_steps(model, opt, 3)
    measured = p.stats().peak_activation_bytes
    assert predicted / 2 <= measured <= predicted, (measured, predicted)
    assert "activations=recompute:" in str(plan) and "saves 960.00 KiB" in str(plan)


def test_plan_of_a_forward_that_reads_values_says_why_it_cannot_measure():
    class ReadsValues(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

        def forward(self, x):
            if x.sum().item() > 0:  # a value: fake tensors have none
                x = x * 2
            for layer in self.layers:
                x = layer(x)
            return x

    model = ReadsValues()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="could not run on fake tensors.*leave `inputs` out"):
        pager.plan(model, "1MiB", device="cpu", inputs=torch.randn(4, 8))
    assert_same_state(model.state_dict(), before)  # nothing changed
    assert pager.plan(model, "1MiB", device="cpu").saved is None


def assert_same_state(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_tensor_saved_twice_leaves_once_and_comes_back_once():
    """Wide's ReLU output is saved by the ReLU and by `down`: offloading
    copies it out once and back once (per backward, a retained graph's second
    too), and the gradients are those of the unwrapped model, bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide() for _ in range(6)])
    ref = copy.deepcopy(model)
    p = offloading(model, streams(model), "offload", inputs=torch.zeros(256, 32))
    x = torch.randn(256, 32)
    model(x).sum().backward()  # learns the order: the last block keeps its own from now on
    ref(x).sum().backward()
    p.reset()
    out, ref_out = model(x).pow(2).sum(), ref(x).pow(2).sum()
    out.backward(retain_graph=True)
    ref_out.backward(retain_graph=True)
    out.backward()
    ref_out.backward()
    s = p.stats()
    once = 5 * 256 * (32 + 128) * 4  # each block but the last: its input and ReLU's output
    assert s.activations_sent_bytes == once and s.activations_brought_bytes == 2 * once
    assert p.activations.ledger.live == 0
    for a, b in zip(model.parameters(), ref.parameters()):
        assert_same(a.grad, b.grad)


def test_the_ledgers_peak_after_a_reset_counts_a_rise_below_the_passs_peak():
    ledger = pager.training.activations.Ledger(torch.device("cpu"))
    ledger.add(100)
    ledger.sub(100)
    ledger.reset_peak()  # stats reset mid-pass: the pass's peak (100) stays for the reserve
    ledger.add(50)
    assert ledger.peak == 50
    ledger.pass_ends()  # the pass's own peak (100) becomes the reserve
    assert ledger.reserve() == 100


class _CopyUnderWay:
    """An event of a copy out that has not landed (as on a GPU)."""

    def query(self):
        return False


def test_activations_being_copied_out_do_not_hold_the_graph_or_the_pager():
    """Device activations wait in a queue while their copy out is under way
    (on a GPU); the queue must hold their memory, not their autograd graph:
    a graph node's hooks hold the pager, which holds the queue, a cycle
    through C++ that the garbage collector cannot break (the H100 kept every
    unwrapped pager and its pinned arena, ~16 GiB a model). And what a
    backward leaves in the queue is let go of when the pass ends."""
    model = nn.Sequential(*[Wide() for _ in range(4)])
    p = offloading(model, streams(model), "offload")
    send = p.transport.send_to_host
    p.transport.send_to_host = lambda t: (send(t)[0], _CopyUnderWay())
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(8, 32)
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        assert p.stats().activation_bytes == 0  # nothing counted after the pass
    out = model(x)  # a forward whose backward never comes: its graph goes with `out`
    assert p.stats().activations_sent_bytes > 0
    alive = weakref.ref(p)
    del out, p
    pager.unwrap(model)
    del model, opt
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("share", [0.2, 0.3])
def test_recomputing_a_larger_block_than_the_last_pass_holds_the_budget(share):
    """A supernet's path differs from step to step, so a pass may recompute
    a wider candidate than the last pass did (and the first pass has no last
    one): blocks fetched before that was known leave before its recomputation
    runs, and every pass holds the budget, the first but for what the head
    saves after the last block's use; values equal the unwrapped supernet's,
    bit for bit."""
    torch.manual_seed(0)
    net = SuperNet(vocab=256, d=64, n_layers=8, widths=(2, 4, 6, 8))
    ref = copy.deepcopy(net)
    budget = int(share * 3 * tensor_page_bytes(net))  # of weights and Adam's two states
    pager.wrap(net, budget=budget, device="cpu", activations="recompute")
    p = pager.of(net)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-3) for m in (net, ref))
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    head_input = 4 * 31 * 64 * 4  # (the head's input, fp32: saved after the last block's use)
    for step in range(8):
        path = [rng.randrange(4) for _ in net.layers]
        net.set_path(path), ref.set_path(path)
        p.expect(net.path_modules(path))
        p.reset()
        ids = torch.randint(0, 256, (4, 32), generator=g)
        for model, o in ((net, opt), (ref, ref_opt)):
            F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
            o.step()
            o.zero_grad()
        s = p.stats()
        assert s.recomputes > 0 and s.peak_device_bytes <= budget + (head_input if step == 0 else 0), (step, s, budget)
    assert_models_equal(net, ref)


class Heads(nn.Module):
    """Attention-shaped saves: a projection's output seen as heads, transposed
    (dense, not contiguous), and a slice of one (not dense)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads, self.q, self.k = heads, nn.Linear(d, d), nn.Linear(d, 2 * d)

    def forward(self, x):
        b, d = x.shape[0], x.shape[-1]
        q = self.q(x).view(b, -1, self.heads, d // self.heads).transpose(1, 2)  # dense
        k = self.k(x).view(b, -1, self.heads, 2 * d // self.heads)[..., : d // self.heads].transpose(1, 2)  # a slice
        return x + F.scaled_dot_product_attention(q, k, q).transpose(1, 2).reshape(x.shape)


def test_transposed_saves_are_offloaded_with_their_strides():
    """A saved view that is a permutation of its storage (attention's q, k
    and v as heads) leaves and comes back with its strides; a slice of a
    storage, which is not dense, stays; values bit for bit."""
    from pager.training.dry_run import _dense

    x = torch.randn(2, 8, 4, 8)
    assert _dense(x.transpose(1, 2)) and _dense(x) and not _dense(x[..., :4].transpose(1, 2))
    torch.manual_seed(0)
    model = nn.Sequential(*[Heads() for _ in range(4)])
    ref = copy.deepcopy(model)
    p = offloading(model, streams(model), "offload")
    saved_types = []
    transport = p.transport
    send = transport.send_to_host

    def recording(t, host=None):
        saved_types.append((t.is_contiguous(), t.stride()))
        out = send(t, host)
        assert out[0].stride() == t.stride()
        return out

    transport.send_to_host = recording
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    for m, o in ((model, opt), (ref, ref_opt)):
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            m(torch.randn(2, 16, 32, generator=g)).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    assert any(not contiguous for contiguous, _stride in saved_types), saved_types  # (the transposed q went)
    assert p.stats().activations_sent_bytes > 0
    pager.unwrap(model)
    assert_models_equal(model, ref)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_kv_cache_a_forward_writes_is_written_once_when_it_is_recomputed(attention):
    """A transformers model trained with `use_cache` (its default): each
    layer appends to the KV cache; recomputed, it appends again unless the
    cache is put back ([Note: caches a forward writes]). Under eager
    attention that was an error (a saved tensor of twice the keys)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attention,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=10 << 20, device="cpu", activations="recompute")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    outs = [m(input_ids=ids, labels=ids) for m in (model, ref)]
    for out in outs:
        out.loss.backward()
    assert pager.of(model).stats().recomputes > 0
    caches = [out.past_key_values for out in outs]
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == 12
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad), n
