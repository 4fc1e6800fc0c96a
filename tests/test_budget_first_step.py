"""The budget holds from the first training step (issue 63): on the CPU
device, a Hugging Face Llama trained with AdamW and torch's clip under a
sweep of budgets and each `activations=` policy: every step's
`peak_device_bytes` (blocks and the activations pager holds) is within the
budget, the first step included, or the first forward is refused before it
runs, naming the least budget that holds; at that budget every step holds,
and the values are the unwrapped model's bit for bit."""

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
    """Steps `first`... of training; `done[0]`: the steps that have run."""
    for step in range(first, first + steps):
        if check is not None:
            pager.of(model).reset()
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
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
        assert s.peak_device_bytes <= p.budget_bytes, (step, s.peak_device_bytes, p.budget_bytes)

    return check


@pytest.mark.parametrize("share", [0.5, 0.8, 1.2, 2.5])
@pytest.mark.parametrize("policy", ["auto", "offload", "recompute"])
@pytest.mark.parametrize("attach", ["at wrap", "at its first step"])
def test_every_step_holds_the_budget_from_the_first(share, policy, attach):
    model = llama()
    ref = copy.deepcopy(model)
    budget = int(share * 4 * tensor_page_bytes(model))  # a share of weights, gradients and AdamW's state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    pager.wrap(model, budget=budget, device="cpu", activations=policy, optimizer=opt if attach == "at wrap" else None)
    p = pager.of(model)
    before = copy.deepcopy(model.state_dict())
    first, done = 0, [0]  # the steps both have run; the steps the wrapped model has run
    for _attempt in range(3):  # (refused again once the state of an optimizer attached at its step appeared)
        try:
            train_steps(model, opt, STEPS - first, within_budget(model), first=first, done=done)
            break
        except pager.BudgetError as e:
            least = e.least_budget_bytes
            assert least is not None and least > p.budget_bytes, str(e)
            ran = done[0]  # refused at a forward's start: the steps before it ran
            assert ran == 0 or attach != "at wrap", str(e)  # (a known optimizer counts from the first)
            if ran == 0:  # refused at the first forward: nothing ran, nothing changed
                assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
                assert all(q.grad is None for q in model.parameters())
            train_steps(ref, ref_opt, ran - first, first=first)
            first = ran
            p.set_budget(least)  # the least budget it names holds
    else:
        raise AssertionError("refused at the budget it named")
    train_steps(ref, ref_opt, STEPS - first, first=first)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_plan_names_the_least_budget_the_defaults_train_with():
    """`pager.plan(..., inputs=, optimizer=)` gives one least budget that
    trains, the one the run with the defaults holds: below it the first
    forward is refused, at it every step holds."""
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = {"input_ids": batch(0), "labels": batch(0)}  # (as the steps call it: the loss saves too)
    plan = pager.plan(model, "1GiB", device="cpu", inputs=inputs, optimizer=opt)
    least = plan.train_min_budget_bytes
    assert str(plan).count("least budget that trains") == 1
    below = pager.plan(model, least - 1, device="cpu", inputs=inputs, optimizer=opt)
    assert not below.trains and "WILL NOT TRAIN" in str(below)
    pager.wrap(model, budget=least - 1, device="cpu", optimizer=opt)
    with pytest.raises(pager.BudgetError) as refused:
        train_steps(model, opt, 1)
    assert refused.value.least_budget_bytes == least
    pager.of(model).set_budget(least)
    train_steps(model, opt, STEPS, within_budget(model))
