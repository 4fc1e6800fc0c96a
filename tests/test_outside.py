"""`wrap(..., budget_covers="process")`, the default: blocks leave room for what the
process holds on the device outside pager, such as the loss ([Note: a
budget that covers the process] in model/outside.py). The figure is read
from CUDA's caching allocator; on the CPU device a stand-in allocator
(`Allocator`) counts what pager holds and what the test's "loss" adds, as
CUDA's would, and the values stay the unwrapped model's bit for bit."""

import copy
import logging

import pytest
import torch
import torch.nn as nn

import pager
from pager.model import outside
from helpers import assert_models_equal, tensor_page_bytes
from test_activations import Wide, offloading

LAYERS = 6


class Allocator:
    """CUDA's counters as the test's process would move them: pager's own
    bytes, what the caller holds (`caller_bytes`), and a transient of the
    loss's backward (`loss`), seen only by the peak."""

    def __init__(self):
        self.outside = None  # the model's `Outside`, to count what pager holds
        self.caller_bytes = 0
        self.peak = 0

    def read(self):
        current = self.outside.held_bytes() + self.caller_bytes
        self.peak = max(self.peak, current)
        return current, self.peak

    def reset_peak(self):
        self.peak = 0

    def loss(self, nbytes):
        """The loss's backward holds `nbytes` more at once, then lets go."""
        self.peak = max(self.peak, self.read()[0] + nbytes)


@pytest.fixture
def allocator(monkeypatch):
    fake = Allocator()
    monkeypatch.setattr(outside, "allocator_counter", lambda device: fake)
    return fake


def block_bytes(model) -> int:
    return 4 * tensor_page_bytes(model[0])  # weights, gradients, Adam's two states


def steps(model, opt, n, allocator=None, loss_bytes=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        loss = model(torch.randn(256, 32, generator=g)).pow(2).mean()
        if allocator is not None:
            allocator.loss(loss_bytes)
        loss.backward()
        opt.step()
        opt.zero_grad()


def trained(budget, covers, allocator=None, loss_bytes=0):
    """Six wide blocks under `budget` (activations offloaded) beside an
    unwrapped copy, 6 steps and 3 more after a reset of the stats."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide() for _ in range(LAYERS)])
    ref = copy.deepcopy(model)
    p = offloading(model, budget, "offload", budget_covers=covers)
    if allocator is not None:
        allocator.outside = p.outside
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    steps(model, opt, 6, allocator, loss_bytes)
    p.reset()
    steps(model, opt, 3, allocator, loss_bytes, seed=1)
    steps(ref, ref_opt, 6)
    steps(ref, ref_opt, 3, seed=1)
    return p, model, ref


def test_blocks_leave_room_for_the_loss(allocator):
    """Without it pager fills the budget, and the loss comes on top; with
    it, pager learns what the loss holds at its peak and its blocks and
    activations stay within the budget less that."""
    # Blocks stream, beside what offloading holds (planned before the first pass: a block's own
    # and two brought back); the loss holds a quarter of the budget.
    budget = 7 * block_bytes(nn.Sequential(*[Wide() for _ in range(LAYERS)]))
    loss_bytes = budget // 4
    p, model, ref = trained(budget, "pager")
    plain = p.stats()
    assert p.outside is None and plain.outside_bytes == 0
    assert plain.peak_device_bytes + loss_bytes > budget  # (the process would hold more than the budget)
    pager.unwrap(model)
    assert_models_equal(model, ref)

    p, model, ref = trained(budget, "process", allocator, loss_bytes)
    s = p.stats()
    assert s.outside_bytes == loss_bytes
    assert s.peak_device_bytes <= budget - loss_bytes, (s.peak_device_bytes, budget - loss_bytes)
    assert s.peak_resident_bytes < plain.peak_resident_bytes  # (blocks gave the room)
    # ("auto" judges a trial pass against the budget less it: [Note: activations, the automatic choice])
    assert p.activations.budget_bytes() == budget - loss_bytes
    assert "outside pager" in str(s)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_what_the_caller_holds_between_steps_counts_too(allocator):
    """Tensors the caller keeps on the device (inputs, metrics) are seen at the
    forward's start and end, without a peak."""
    budget = 7 * block_bytes(nn.Sequential(*[Wide() for _ in range(LAYERS)]))
    allocator.caller_bytes = budget // 5
    p, model, ref = trained(budget, "process", allocator)
    s = p.stats()
    assert p.outside.prediction < budget // 5  # (more than the dry run predicts: learned)
    assert s.outside_bytes == budget // 5
    assert s.peak_device_bytes <= budget - budget // 5
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_what_the_caller_holds_counts_from_the_first_forward(allocator):
    """What the caller holds when a forward starts is read before any block
    is fetched: blocks leave it room in the first forward (an inference one
    here, which no measure predicts), not from the one after it; once the
    caller lets go of it, the next forward's blocks take the room back."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide() for _ in range(LAYERS)])
    ref = copy.deepcopy(model)
    page = tensor_page_bytes(model[0])
    allocator.caller_bytes = 4 * page
    budget = allocator.caller_bytes + 3 * page
    pager.wrap(model, budget=budget, device="cpu")  # (the default covers the process)
    p = pager.of(model)
    allocator.outside = p.outside
    x = torch.randn(256, 32)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    s = p.stats()
    assert s.outside_bytes == allocator.caller_bytes and s.evictions > 0
    assert s.peak_device_bytes <= budget - allocator.caller_bytes, (s.peak_device_bytes, budget)
    allocator.caller_bytes = 0  # (let go of: the next forward's start sees it gone, and blocks take the room)
    p.reset()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    s = p.stats()
    assert s.outside_bytes == 0 and s.peak_device_bytes > 3 * page, (s.outside_bytes, s.peak_device_bytes)
    pager.unwrap(model)


def test_two_models_wrapped_apart_do_not_crowd_each_other(monkeypatch):
    """Each model's blocks are its engine's, under a budget of its own: the
    other model's, which the allocator sees too, are not the caller's, and
    each keeps its room."""
    pagers = []

    class Both(Allocator):
        def read(self):
            current = sum(p.engine.resident_bytes for p in pagers) + self.caller_bytes
            self.peak = max(self.peak, current)
            return current, self.peak

    monkeypatch.setattr(outside, "allocator_counter", lambda device: Both())
    torch.manual_seed(0)
    models = [nn.Sequential(*[Wide() for _ in range(LAYERS)]) for _ in range(2)]
    page = tensor_page_bytes(models[0][0])
    for m in models:
        pager.wrap(m, budget=3 * page, device="cpu")
        pagers.append(pager.of(m))
    x = torch.randn(256, 32)
    with torch.no_grad():
        for _ in range(2):
            for m in models:
                m(x)
    for p in pagers:
        s = p.stats()
        assert s.outside_bytes == 0 and s.peak_resident_bytes == 3 * page, (s.outside_bytes, s.peak_resident_bytes)
    for m in models:
        pager.unwrap(m)


def test_a_forward_refused_for_what_the_caller_held_trains_once_it_lets_go(allocator):
    """A refusal forgets what was learned: a tensor the caller held for a
    while is read again at the next forward's start, not held against the
    model for good."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide() for _ in range(LAYERS)])
    ref = copy.deepcopy(model)
    budget = 7 * block_bytes(model)
    p = offloading(model, budget, "offload", budget_covers="process")
    allocator.outside = p.outside
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    allocator.caller_bytes = budget  # (no room left beside it)
    with pytest.raises(pager.BudgetError, match="outside pager"):
        steps(model, opt, 1, allocator)
    allocator.caller_bytes = 0
    steps(model, opt, 2, allocator)
    steps(ref, ref_opt, 2)
    assert p.stats().outside_bytes < budget // 4
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_an_output_kept_into_the_next_step_counts_once(allocator):
    """`out = model(x)` keeps the last step's output while the next forward
    runs: at that forward's end two outputs are held, during the loss one
    output and the loss. What is learned is the most held at once, not the
    two added up."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide() for _ in range(LAYERS)])
    budget = 7 * block_bytes(model)
    out_bytes, loss_bytes = budget // 20, budget // 8
    p = offloading(model, budget, "offload", budget_covers="process")
    allocator.outside = p.outside

    def output_made(module, args, output):  # (the last block's: before the root's post-hook)
        allocator.caller_bytes += out_bytes

    model[-1].register_forward_hook(output_made)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        allocator.caller_bytes = out_bytes if step else 0  # (the last step's output, alive)
        out = model(torch.randn(256, 32, generator=g))
        allocator.caller_bytes = out_bytes  # (the last one let go of at the assignment)
        allocator.loss(loss_bytes)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert p.outside.prediction < out_bytes + loss_bytes
    assert p.stats().outside_bytes == out_bytes + loss_bytes, (p.stats().outside_bytes, out_bytes, loss_bytes)
    pager.unwrap(model)


def test_a_model_of_a_pool_that_does_not_run_keeps_no_old_figure(allocator):
    """What the caller holds is read at every forward's start on the device,
    for every model there: once it lets go of a tensor, the pool's other
    model, which has not run since, does not keep holding it against the
    pool's room."""
    torch.manual_seed(0)
    models = [nn.Sequential(*[Wide() for _ in range(LAYERS)]) for _ in range(2)]
    page = tensor_page_bytes(models[0][0])
    pool = pager.Pool(budget=8 * page, device="cpu")
    for i, m in enumerate(models):
        pager.wrap(m, pool=pool, name=f"m{i}")
    allocator.outside = pager.of(models[0]).outside
    x = torch.randn(256, 32)
    allocator.caller_bytes = 3 * page
    with torch.no_grad():
        models[0](x)
        allocator.caller_bytes = 0
        models[1](x)
    assert [pager.of(m).stats().outside_bytes for m in models] == [0, 0]
    pool.reset()
    with torch.no_grad():
        models[1](x)
    assert pool.stats().peak_resident_bytes > 5 * page  # (the room back)
    for m in models:
        pager.unwrap(m)


def test_a_graph_built_asleep_is_not_taken_for_the_callers(allocator):
    """A model that fits trains with its hooks off under a budget that covers
    the process and learns from the allocator ([Note: asleep]), where the
    measure predicted what sits outside pager. Autograd's activations of such
    a forward are not pager's to count: while its graph lives, a second
    forward of the same step (a pair of losses) learns nothing from them;
    values as the unwrapped model's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Wide() for _ in range(LAYERS)])
    ref = copy.deepcopy(model)
    p = offloading(model, 1 << 30, "auto", budget_covers="process")
    allocator.outside = p.outside
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    steps(model, opt, 3, allocator)
    steps(ref, ref_opt, 3)
    learned = p.stats().outside_bytes
    assert p.outside.prediction > 0 and p.stats().resident_forwards > 0  # (trained asleep)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(256, 32, generator=g) for _ in range(2)]
    for m, o in ((model, opt), (ref, ref_opt)):
        first = m(xs[0]).pow(2).mean()
        if m is model:
            allocator.caller_bytes += 1 << 20  # (the allocator sees the first forward's activations)
        (first + m(xs[1]).pow(2).mean()).backward()
        if m is model:
            allocator.caller_bytes -= 1 << 20
        o.step()
        o.zero_grad()
    assert p.stats().outside_bytes == learned
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_a_loss_larger_than_the_budget_leaves_is_refused_when_seen(allocator):
    """What the process holds outside pager is seen only once a pass ran: a
    loss that leaves blocks and activations less than they need is refused
    at the next forward, before it runs, naming what the process held
    outside pager and the least budget that holds; at that budget the
    values stay the unwrapped model's."""
    budget = 7 * block_bytes(nn.Sequential(*[Wide() for _ in range(LAYERS)]))
    with pytest.raises(pager.BudgetError, match="outside pager") as refused:
        trained(budget, "process", allocator, loss_bytes=budget)
    assert refused.value.least_budget_bytes > budget  # (the loss, and blocks and activations beside it)


def causal_lm():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("loss_inside", [True, False], ids=["loss in the forward", "loss by the caller"])
def test_a_process_budget_is_predicted_before_the_first_step(loss_inside):
    """[Note: what sits outside pager, predicted]: on the CPU device (no
    allocator to learn from) a budget that covers the process leaves, from
    the first step, room for the inputs, the logits and the loss's backward
    (two float32 copies of the logits, three where the caller computes the
    loss), and the values stay the unwrapped model's."""
    model = causal_lm()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 1024, (4, 32), generator=torch.Generator().manual_seed(0))
    logits = 4 * 32 * 1024 * 4
    budget = 3 * 4 * tensor_page_bytes(model.model.layers[0]) + 4 * tensor_page_bytes(model.lm_head) + 6 * logits
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    pager.wrap(model, budget=budget, device="cpu", optimizer=opt)  # (the default covers the process)
    p = pager.of(model)
    for step in range(3):
        p.reset()
        for m, o in ((model, opt), (ref, ref_opt)):
            if loss_inside:
                loss = m(input_ids=ids, labels=ids).loss
            else:
                out = m(input_ids=ids).logits
                loss = nn.functional.cross_entropy(out.flatten(0, 1), ids.flatten())
            loss.backward()
            o.step()
            o.zero_grad()
        s = p.stats()
        inputs = (2 if loss_inside else 1) * ids.nbytes
        expected = inputs + logits + (4 + 2 * logits if loss_inside else 3 * logits)  # (4: the loss)
        assert s.outside_bytes == expected, (s.outside_bytes, expected)
        assert s.peak_device_bytes + s.outside_bytes <= budget, (step, s.peak_device_bytes, s.outside_bytes)
        assert s.evictions > 0
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_the_budget_covers_the_process_by_default_and_pager_alone_predicts_nothing():
    ids = torch.zeros(2, 16, dtype=torch.long)
    seen = {}
    for covers in (None, "pager"):
        model = causal_lm()
        pager.wrap(model, budget="64MiB", device="cpu", **({} if covers is None else {"budget_covers": covers}))
        model(input_ids=ids, labels=ids).loss.backward()
        seen[covers] = (pager.of(model).outside is not None, pager.of(model).stats().outside_bytes)
    assert seen[None][0] and seen[None][1] > 2 * 16 * 1024 * 4  # (the logits, at least)
    assert seen["pager"] == (False, 0)


def test_a_smaller_batch_measured_later_keeps_the_larger_prediction():
    """The measure runs again only where a dimension grows: after (8, 64)
    and then (2, 128), a batch of (8, 64) comes unmeasured, so the room
    predicted for it stays."""
    model = causal_lm()
    pager.wrap(model, budget="256MiB", device="cpu", budget_covers="process")
    p = pager.of(model)
    predicted = []
    for shape in ((8, 64), (2, 128), (8, 64)):
        ids = torch.zeros(shape, dtype=torch.long)
        model(input_ids=ids, labels=ids).loss.backward()
        predicted.append(p.stats().outside_bytes)
    assert predicted[0] > 0 and predicted == [predicted[0]] * 3
