"""The budget holds from the first training step (issue 63): on the CPU
device, a Hugging Face Llama trained with AdamW and torch's clip under a
sweep of budgets and each `activations=` policy: every step's
`peak_device_bytes` (blocks and the activations pager holds) is within the
budget, the first step included, or the first forward is refused before it
runs, naming the least budget that holds (an optimizer not known until its
first step: that step is refused before it updates anything); at that
budget every step holds, and the values are the unwrapped model's bit for
bit."""

import copy

import pytest
import torch

import pager
from helpers import assert_models_equal, tensor_page_bytes

transformers = pytest.importorskip("transformers")

STEPS = 3


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def batch(step, size=(4, 64)):
    return torch.randint(0, 512, size, generator=torch.Generator().manual_seed(step))


def train_steps(model, opt, steps, check=None, first=0, done=None):
    """Steps `first`... of training; `done[0]`: the steps that have run,
    `done[1]`: where the last one is ("forward" or "step")."""
    for step in range(first, first + steps):
        if check is not None:
            pager.of(model).reset()
        ids = batch(step)
        if done is not None:
            done[1] = "forward"
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if done is not None:
            done[1] = "step"
        opt.step()
        opt.zero_grad()
        if done is not None:
            done[0] = step + 1
        if check is not None:
            check(step)


def within_budget(model):
    p = pager.of(model)

    def check(step):
        s = p.stats()
        if p.outside is not None:  # (covering the process: blocks and activations left room for the loss)
            assert s.outside_bytes > 0 and s.outside_bytes == p.outside.prediction
        assert s.peak_device_bytes + s.outside_bytes <= p.budget_bytes, (step, s, p.budget_bytes)

    return check


@pytest.mark.parametrize("share", [0.5, 0.8, 1.2, 2.5])
@pytest.mark.parametrize("policy", ["auto", "offload", "recompute"])
@pytest.mark.parametrize("attach", ["at wrap", "at its first step"])
def test_every_step_holds_the_budget_from_the_first(share, policy, attach):
    """Under a budget that covers the process (its prediction is all the CPU
    device knows): blocks and activations within the budget less what the
    loss and the logits hold, from the first step."""
    model = llama()
    ref = copy.deepcopy(model)
    budget = int(share * 4 * tensor_page_bytes(model))  # a share of weights, gradients and AdamW's state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    optimizer = opt if attach == "at wrap" else None
    pager.wrap(model, budget=budget, device="cpu", activations=policy, optimizer=optimizer, budget_covers="process")
    p = pager.of(model)
    before = copy.deepcopy(model.state_dict())
    first, done = 0, [0, None]  # the steps both have run; the steps the wrapped model has run, and where
    for _attempt in range(3):  # (refused at the first forward, then at the first step once its optimizer attached)
        try:
            train_steps(model, opt, STEPS - first, within_budget(model), first=first, done=done)
            break
        except pager.BudgetError as e:
            least = e.least_budget_bytes
            assert least is not None and least > p.budget_bytes, str(e)
            # Refused at the first forward or, where the optimizer was not known
            # then, at its first step: before anything changed either way.
            assert done[0] == 0 and (done[1] == "forward" or attach != "at wrap"), (done, str(e))
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
            p.set_budget(least)  # the least budget it names holds
            if done[1] == "forward":
                assert all(q.grad is None for q in model.parameters())
                continue
            assert not opt.state and "This step did not run" in str(e) and "torch.no_grad()" not in str(e)
            opt.step()  # (the refused step, again: its gradients are there)
            opt.zero_grad()
            train_steps(ref, ref_opt, 1)
            first = done[0] = 1
            within_budget(model)(0)
    else:
        raise AssertionError("refused at the budget it named")
    train_steps(ref, ref_opt, STEPS - first, first=first)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def qwen2():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        use_cache=False,
    )
    return transformers.Qwen2ForCausalLM(config)


@pytest.mark.parametrize("covers", ["pager", "process"])
@pytest.mark.parametrize("make", [llama, qwen2])
def test_plan_names_the_least_budget_the_defaults_train_with(make, covers):
    """`pager.plan(..., inputs=, optimizer=)` gives one least budget that
    trains, the one the run with the defaults holds: below it the first
    forward is refused, at it every step holds. The inputs are a Hugging
    Face model's keyword arguments with `labels`, as the steps call it: the
    loss it computes inside saves for the backward too."""
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = {"input_ids": batch(0), "labels": batch(0)}  # (as the steps call it: the loss saves too)
    plan = pager.plan(model, "1GiB", device="cpu", inputs=inputs, optimizer=opt, budget_covers=covers)
    least = plan.train_min_budget_bytes
    assert (plan.outside_bytes > 0) == (covers == "process")
    assert plan.activations_measured and plan.trains is True
    assert least > plan.train_blocks_min_bytes and str(plan).count("least budget that trains") == 1
    assert not any("labels" in n for n in plan.notes)
    below = pager.plan(model, least - 1, device="cpu", inputs=inputs, optimizer=opt, budget_covers=covers)
    assert below.trains is False and "WILL NOT TRAIN" in str(below)
    # Without labels the loss is not measured: less, and the plan says why.
    unlabelled = pager.plan(
        model, least - 1, device="cpu", inputs={"input_ids": batch(0)}, optimizer=opt, budget_covers=covers
    )
    assert unlabelled.train_min_budget_bytes < least and any("`labels`" in n for n in unlabelled.notes)
    assert "ESTIMATED" not in str(plan)
    # Without the optimizer its state is an estimate (AdamW keeps `step` tensors too), and the plan says so.
    estimated = pager.plan(model, "1GiB", device="cpu", inputs=inputs, budget_covers=covers)
    assert estimated.train_min_budget_bytes < least and "optimizer state ESTIMATED at 2x" in str(estimated)
    pager.wrap(model, budget=least - 1, device="cpu", optimizer=opt, budget_covers=covers)
    with pytest.raises(pager.BudgetError) as refused:
        train_steps(model, opt, 1)
    assert refused.value.least_budget_bytes == least
    pager.of(model).set_budget(least)
    train_steps(model, opt, STEPS, within_budget(model))


def test_a_plan_without_inputs_names_no_budget_that_trains():
    """[Note: a plan without inputs]: without the forward's inputs the plan
    counts no activations. Its figure is what blocks need, a lower bound it
    says is one; it names no least budget that trains and, at a budget
    between the two, does not know whether it trains (`trains` is None),
    where the run refuses; below the blocks' figure it does not train."""
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = {"input_ids": batch(0), "labels": batch(0)}
    least = pager.plan(model, "1GiB", device="cpu", inputs=inputs, optimizer=opt).train_min_budget_bytes
    plan = pager.plan(model, least - 1, device="cpu", optimizer=opt)
    text = str(plan)
    assert not plan.activations_measured and plan.saved is None
    assert plan.train_min_budget_bytes is None and plan.trains is None
    assert plan.train_blocks_min_bytes < least and plan.runs
    assert "least budget that trains" not in text and "WILL NOT TRAIN" not in text
    assert "ACTIVATIONS NOT COUNTED" in text and "lower bound" in text
    blocks = plan.train_blocks_min_bytes  # (the same as with inputs)
    assert blocks == pager.plan(model, "1GiB", device="cpu", inputs=inputs, optimizer=opt).train_blocks_min_bytes
    short = pager.plan(model, blocks - 1, device="cpu", optimizer=opt)
    assert short.trains is False and "WILL NOT TRAIN" in str(short)
    pager.wrap(model, budget=least - 1, device="cpu", optimizer=opt)
    with pytest.raises(pager.BudgetError):  # (the budget the plan could not say trains: it does not)
        train_steps(model, opt, 1)


LLAMA_MODULE = """
import transformers


def build():
    import torch

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=4, tie_word_embeddings=False, use_cache=False))
"""


def test_the_plan_command_takes_named_inputs_and_exits_1_where_it_will_not_train(tmp_path, monkeypatch, capsys):
    """`python -m pager plan` with the forward's keyword arguments
    (`--inputs input_ids=...`, `--labels`) and `--optimizer` gives the least
    budget `plan()` gives with them (the run's: the process's by default,
    or pager's alone), exits 0 at it and 1 below;
    without inputs it runs, says activations are not counted and names no
    budget that trains; `--optimizer` without inputs is a usage error."""
    from pager.__main__ import main

    (tmp_path / "mylm.py").write_text(LLAMA_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = llama()
    opt = torch.optim.AdamW(model.parameters())
    zeros = torch.zeros(4, 64, dtype=torch.long)
    least = pager.plan(model, "1GiB", device="cpu", inputs={"input_ids": zeros, "labels": zeros}, optimizer=opt)
    least = least.train_min_budget_bytes  # (the process's: the loss and logits counted too)

    def run(budget, *more):
        code = main(["plan", "mylm:build", "--budget", str(budget), "--device", "cpu", *more])
        return code, capsys.readouterr().out

    train = ["--inputs", "input_ids=4x64:int64", "--labels", "--optimizer", "AdamW"]
    code, out = run(least, *train)
    assert code == 0 and f"least budget that trains {pager.format_bytes(least, up=True)}" in out
    code, out = run(least - 1, *train)
    assert code == 1 and "WILL NOT TRAIN" in out
    named = ["--inputs", "input_ids=4x64:int64", "--inputs", "labels=4x64:int64", "--optimizer", "AdamW"]
    assert run(least - 1, *named)[0] == 1 and run(least, *named)[0] == 0  # (labels named: the same figure)
    alone = pager.plan(
        model, "1GiB", device="cpu", inputs={"input_ids": zeros, "labels": zeros}, optimizer=opt, budget_covers="pager"
    ).train_min_budget_bytes  # (pager's own bytes alone)
    assert alone < least and run(alone - 1, *train, "--budget-covers", "pager")[0] == 1
    assert run(alone, *train, "--budget-covers", "pager")[0] == 0
    unlabelled = ["--inputs", "input_ids=4x64:int64", "--optimizer", "AdamW", "--budget-covers", "pager"]
    code, out = run(alone - 1, *unlabelled)  # no labels: less (the model's loss saves nothing)
    assert code == 0 and "`labels`" in out
    assert run(alone - 1, "--inputs", "4x64:int64", "--budget-covers", "pager")[0] == 0  # (the positional form)
    code, out = run(least - 1)  # inference: it runs; the training figure excludes activations
    assert code == 0 and "ACTIVATIONS NOT COUNTED" in out and "least budget that trains" not in out
    for wrong in (
        ["--optimizer", "AdamW"],  # (without inputs: whether it trains is not known)
        ["--inputs", "4x64:int64", "--inputs", "labels=4x64:int64"],  # (positional and named)
        ["--inputs", "4x64:int64", "--labels"],  # (no input named input_ids)
        ["--inputs", "input_ids=4x64:int64", "--optimizer", "Adamm"],
    ):
        with pytest.raises(SystemExit) as stop:
            run(least, *wrong)
        assert stop.value.code == 2, wrong
    if hasattr(torch.optim, "Muon"):  # an optimizer that cannot be built on the model (2D parameters only)
        argv = ["plan", "mylm:build", "--budget", str(least), "--device", "cpu", "--inputs", "input_ids=4x64:int64"]
        assert main([*argv, "--optimizer", "Muon"]) == 2
        assert "Muon only supports 2D parameters" in capsys.readouterr().err


def test_the_measure_on_fake_tensors_changes_nothing_and_moves_nothing():
    """[Note: activations measured without running]: the measure before the
    first pass fetches no page, leaves the random number generators, the
    buffers and the parameters as they were, and its forward's hooks of
    pager's count no use; the values are the unwrapped model's."""
    model = llama()
    ref = copy.deepcopy(model)
    budget = int(1.2 * 4 * tensor_page_bytes(model))
    pager.wrap(model, budget=budget, device="cpu")
    p = pager.of(model)
    ids = batch(0)
    measured = []
    measure = p.activations.measure

    def counted(args, kwargs):
        before = (p.stats().h2d_bytes, p.stats().hits + p.stats().misses, torch.get_rng_state())
        out = measure(args, kwargs)
        after = p.stats()
        assert (after.h2d_bytes, after.hits + after.misses) == before[:2]  # no page moved, no use counted
        assert torch.equal(torch.get_rng_state(), before[2])
        measured.append(out[0])
        return out

    p.activations.measure = counted
    torch.manual_seed(1)
    loss = model(input_ids=ids, labels=ids).loss
    torch.manual_seed(1)
    ref_loss = ref(input_ids=ids, labels=ids).loss
    assert len(measured) == 1 and measured[0].order[0] == "model.layers.0"
    assert torch.equal(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    model(input_ids=ids, labels=ids)  # (the same inputs: measured once)
    assert len(measured) == 1
    model(input_ids=batch(1, (8, 64)), labels=batch(1, (8, 64)))  # larger inputs: measured again
    assert len(measured) == 2 and measured[1].total > measured[0].total
    pager.unwrap(model)
    for (n, a), (_n, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_a_forward_that_cannot_run_on_fake_tensors_learns_as_it_runs(caplog):
    """A forward that reads a value cannot be measured on fake tensors: its
    first pass runs under recompute (it holds least), the reserve growing as
    it goes, and says so at INFO; the values are the unwrapped model's."""
    import logging

    class ReadsValues(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(4)])

        def forward(self, x):
            if x.sum().item() > -1e9:  # a value: fake tensors have none
                for layer in self.layers:
                    x = torch.tanh(layer(x))
            return x

    torch.manual_seed(0)
    model = ReadsValues()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=1 << 20, device="cpu")
    with caplog.at_level(logging.INFO, logger="pager"):
        for m in (model, ref):
            m(torch.ones(64, 32)).sum().backward()
    assert "could not run on fake tensors" in caplog.text and "learns what activations hold" in caplog.text
    s = pager.of(model).stats()
    assert s.activations_policy == "recompute" and s.recomputes > 0
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_an_interrupt_inside_the_measure_leaves_nothing_on():
    """A KeyboardInterrupt while the forward runs on fake tensors: pager's
    hooks are on again, no saving frame is left, and the next step measures
    and trains as the unwrapped model."""
    from pager.base import saving
    from pager.base.common import dry_running

    model = llama()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=int(1.2 * 4 * tensor_page_bytes(model)), device="cpu")
    layer = model.model.layers[2]
    hook = layer.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        model(input_ids=batch(0), labels=batch(0))
    hook.remove()
    assert not dry_running() and saving.depth() == 0 and pager.of(model).hooks.root_depth == 0
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    train_steps(model, opt, 2, within_budget(model))
    train_steps(ref, ref_opt, 2)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_a_longer_sequence_is_measured_again_and_a_smaller_batch_after_a_refusal():
    """The measure is made again when an input grows in any dimension (a
    longer sequence at the same number of tokens too); after a refusal, a
    smaller batch is measured again, and trains within the budget."""
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    budget = int(1.2 * 4 * tensor_page_bytes(model))
    pager.wrap(model, budget=budget, device="cpu", optimizer=opt)
    p = pager.of(model)
    measured = []
    measure = p.activations.measure
    p.activations.measure = lambda args, kwargs: measured.append(1) or measure(args, kwargs)

    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    step(batch(0, (8, 32)))
    step(batch(1, (4, 32)))  # (smaller: not measured again)
    assert len(measured) == 1
    step(batch(2, (1, 256)))  # the same tokens, a longer sequence
    assert len(measured) == 2
    with pytest.raises(pager.BudgetError):
        step(batch(3, (64, 256)))
    p.reset()
    step(batch(4, (2, 64)))  # measured again: it holds
    assert len(measured) == 4 and p.stats().peak_device_bytes <= budget


def test_what_a_forward_sets_on_its_modules_is_put_back_after_the_measure():
    """A block that builds a cache in an attribute at its first call and
    counts its calls: the measure on fake tensors leaves neither behind."""

    class Caching(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 32)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if getattr(self, "cache", None) is None:
                self.cache = torch.ones_like(x)
            return torch.tanh(self.lin(x)) * self.cache

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Caching() for _ in range(4)])
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=1 << 20, device="cpu")
    x = torch.randn(16, 32)
    for m in (model, ref):
        m(x).sum().backward()
    assert [layer.calls for layer in model] == [1, 1, 1, 1]
    assert all(type(layer.cache) is torch.Tensor for layer in model)
    pager.unwrap(model)
    assert_models_equal(model, ref)
