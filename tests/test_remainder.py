"""Nothing resident by force ([Note: nothing resident by force] in
api/fit.py): under the defaults the embedding and the head page as blocks of
their own, with their gradients and optimizer state, so the least budget
that trains is set by the largest block, not by two vocabulary matrices held
for life; what is small (norms) stays. On the CPU device, bit for bit."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_models_equal, assert_same, tensor_page_bytes

import pager

transformers = pytest.importorskip("transformers")

STEPS = 3


def llama(tie=False):
    """A Llama whose embedding and head (2 MiB each) are larger than a layer."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=tie,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def batch(step):
    return torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(step))


def train(model, opt, steps, budget=None):
    for step in range(steps):
        if budget is not None:
            pager.of(model).reset()
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if budget is not None:
            peak = pager.of(model).stats().peak_device_bytes
            assert peak <= budget, (step, peak, budget)


def least_budget(model, blocks=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = {"input_ids": batch(0), "labels": batch(0)}
    return pager.plan(model, "1GiB", device="cpu", inputs=inputs, optimizer=opt, blocks=blocks).train_min_budget_bytes


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_the_embedding_and_the_head_page_and_train_bit_for_bit_below_the_old_least_budget(tie):
    model = llama(tie)
    ref = copy.deepcopy(model)
    layers = list(model.model.layers)
    old_least, least = least_budget(model, blocks=layers), least_budget(model)
    # The vocabulary matrices with their gradients and AdamW state no longer sit beside the largest
    # block: one of them (a tied one: with its head) is the largest block now.
    embed = tensor_page_bytes(model.model.embed_tokens)
    assert least <= old_least - (0 if tie else 4 * embed) - 1, (least, old_least, embed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pager.wrap(model, budget=least, device="cpu", optimizer=opt)
    names = pager.of(model).block_names()
    assert "model.embed_tokens" in names and "lm_head" in names and "model.norm" not in names
    train(model, opt, STEPS, budget=least)
    moved = {b.name: b for b in pager.of(model).stats().blocks}
    assert moved["model.embed_tokens"].evictions > 0 and (tie or moved["lm_head"].evictions > 0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    train(ref, ref_opt, STEPS)
    with torch.no_grad():
        assert_same(model(input_ids=batch(9)).logits, ref(input_ids=batch(9)).logits)
    pager.unwrap(model)
    assert_models_equal(model, ref)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie


def test_tables_kept_whole_by_rows_still_page_as_blocks():
    """`rows=[]` (no table by rows, ever) leaves the embedding and head to
    default discovery: blocks of their own."""
    model = llama()
    pager.wrap(model, budget="64MiB", device="cpu", rows=[])
    assert {"model.embed_tokens", "lm_head"} <= set(pager.of(model).block_names())


def test_blocks_naming_the_layers_keeps_the_embedding_and_head_on_the_device():
    model = llama()
    pager.wrap(model, budget="64MiB", device="cpu", blocks=list(model.model.layers))
    p = pager.of(model)
    assert not {"model.embed_tokens", "lm_head"} & set(p.block_names())
    assert p.stats().resident_bytes >= 2 * tensor_page_bytes(model.lm_head)


def test_a_budget_the_old_remainder_broke_is_refused_naming_the_least_with_the_new_one():
    """At a budget below one vocabulary matrix with its state, the refusal
    names the least budget, which then trains."""
    model = llama()
    least = least_budget(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pager.wrap(model, budget=least - 1, device="cpu", optimizer=opt)
    ids = batch(0)
    with pytest.raises(pager.BudgetError) as e:
        model(input_ids=ids, labels=ids)
    assert e.value.least_budget_bytes == least
    pager.of(model).set_budget(least)
    train(model, opt, 2, budget=least)


class FunctionalHead(nn.Module):
    """An LM whose head reads the embedding's weight without calling the
    embedding (F.linear on it): that read is served from the page."""

    def __init__(self, d=512):
        super().__init__()
        self.embed = nn.Embedding(4096, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.norm = nn.LayerNorm(d)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return F.linear(self.norm(h), self.embed.weight)


def test_a_head_reading_the_embedding_weight_directly_trains_bit_for_bit():
    torch.manual_seed(0)
    model = FunctionalHead()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    # The least budget: the embedding with its state, and no room for a layer beside it. (Sequences
    # long enough that activations hold more than the embedding's first update holds beside its page
    # at the step, 16 MiB of new state: the least is then the forward's.)
    def long_batch(step):
        return torch.randint(0, 4096, (2, 1024), generator=torch.Generator().manual_seed(step))

    budget = pager.plan(model, "1GiB", device="cpu", inputs=long_batch(0), optimizer=opt).train_min_budget_bytes
    pager.wrap(model, budget=budget, device="cpu", optimizer=opt)
    assert "embed" in pager.of(model).block_names()
    for step in range(STEPS):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(long_batch(step)).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
            o.zero_grad()
    embed = next(b for b in pager.of(model).stats().blocks if b.name == "embed")
    assert embed.evictions > 0  # (it left between its lookup and the head's read, and came back for it)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_a_host_budget_sized_by_the_blocks_wrap_makes_loads_and_runs(tmp_path):
    """`pager.load`'s host budget holds two of the largest pages as `wrap`
    chooses them: the embedding and the head are blocks, so a host budget
    smaller than both together (the old resident remainder) is taken."""
    ref = llama().eval()
    ref.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(ref.config)
    embed = tensor_page_bytes(ref.model.embed_tokens)
    host = 2 * embed + embed // 2  # (two of the largest pages, less than the two tables and a layer)
    pager.load(model, tmp_path, budget=host, host_budget=host, device="cpu")
    assert {"model.embed_tokens", "lm_head"} <= set(pager.of(model).block_names())
    with torch.no_grad():
        assert_same(model(input_ids=batch(0)).logits, ref(input_ids=batch(0)).logits)


def test_a_weight_tied_into_two_modules_is_said_to_page_once(caplog):
    """T5's `shared` and `encoder.embed_tokens` hold one weight: one block
    holds it, and the log says so once (it named both, each with its size)."""
    config = transformers.T5Config(vocab_size=4096, d_model=128, d_kv=16, d_ff=64, num_layers=2, num_heads=4)
    model = transformers.T5EncoderModel(config)
    assert model.shared.weight is model.encoder.embed_tokens.weight
    with caplog.at_level("INFO", logger="pager"):
        pager.wrap(model, budget="64MiB", device="cpu")
    said = [r.getMessage() for r in caplog.records if "pages as a block of its own" in r.getMessage()]
    assert len(said) == 1 and "2.00 MiB" in said[0], said
    pager.unwrap(model)
