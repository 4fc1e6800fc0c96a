"""Fine-tuning adapters on a frozen model ([Note: frozen pages] in
base/block.py): the frozen parameters of a block live on a page of their own
that is never written back and keeps its encoding; training equals the
unwrapped model bit for bit on the CPU device, with LoRA written out here and
through `peft` on a Hugging Face Llama."""

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pager
import pager.engine.tiers as tiers
from helpers import tensor_page_bytes
from models import TinyLM
from test_training import OPTIMIZERS, batches, lm_loss, train


class Adapted(nn.Module):
    """A frozen linear layer with a trainable low-rank update (LoRA)."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


def adapted_lm(dtype=torch.float32, seed=0, d=64, rank=4):
    """TinyLM, frozen, with adapters on every linear layer of its layers."""
    torch.manual_seed(seed)
    model = TinyLM(d=d).to(dtype)
    model.requires_grad_(False)
    for layer in model.layers:
        layer.attn.qkv = Adapted(layer.attn.qkv, rank)
        layer.attn.proj = Adapted(layer.attn.proj, rank)
        layer.mlp[0] = Adapted(layer.mlp[0], rank)
        layer.mlp[2] = Adapted(layer.mlp[2], rank)
    return model.to(dtype)


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def written_back_by_kind(monkeypatch) -> dict:
    """Bytes of the pages written back to the host, by segment kind."""
    written: dict = {}
    down = tiers.HostTier.down

    def counting(self, block, seg, after=()):
        written[seg.kind] = written.get(seg.kind, 0) + seg.nbytes
        return down(self, block, seg, after)

    monkeypatch.setattr(tiers.HostTier, "down", counting)
    return written


def streaming_budget(model, blocks=2.5):
    """The remainder with its gradients and state, and room for `blocks` layers."""
    layer = max(tensor_page_bytes(layer) for layer in model.layers)
    remainder = tensor_page_bytes(model) - sum(tensor_page_bytes(layer) for layer in model.layers)
    return 4 * remainder + int(blocks * layer)


def assert_params_equal(model, ref):
    for (name, a), (_n, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name


def test_adapters_train_bit_for_bit_and_frozen_pages_are_never_written_back(monkeypatch):
    """Adapters too large to stay on the device (a small budget) page with
    their block, on a page of their own beside the frozen one."""
    model = adapted_lm()
    ref = copy.deepcopy(model)
    written = written_back_by_kind(monkeypatch)
    pager.wrap(model, budget=streaming_budget(model), device="cpu")
    pg = pager.of(model)
    layers = [b for b in pg.blocks if b.module in set(model.layers)]
    assert all(set(b.segments) == {"weights", "frozen"} for b in layers)
    # The adapters are on the small page; the frozen weights and the norms on theirs.
    assert all(b.segments["frozen"].nbytes > 4 * b.segments["weights"].nbytes for b in layers)
    opt, ref_opt = OPTIMIZERS["adamw"](trainable(model)), OPTIMIZERS["adamw"](trainable(ref))
    clip = lambda m: torch.nn.utils.clip_grad_norm_(trainable(m), 0.5)  # noqa: E731
    train(model, opt, batches(5), clip=clip)
    train(ref, ref_opt, batches(5), clip=clip)
    pager.unwrap(model)
    assert_params_equal(model, ref)
    assert "frozen" not in written
    assert pg.stats().evictions > 0
    # What left is the adapters' pages: their weights and AdamW state at most
    # once a step (5), their gradients at most once a backward (7) and once a
    # step (zeroed in place, or updated by a deferred step).
    for kind, times in (("weights", 5), ("state", 5), ("grads", 7 + 5)):
        assert 0 < written[kind] <= times * sum(b.segments[kind].nbytes for b in layers), kind


def test_small_adapters_stay_on_the_device_and_nothing_is_written_back(monkeypatch):
    """[Note: adapters stay on the device]: with room for them, the adapters
    join the remainder, their blocks are frozen and stream read-only."""
    model = adapted_lm(d=256, rank=2)
    ref = copy.deepcopy(model)
    written = written_back_by_kind(monkeypatch)
    adapters = sum(tensor_page_bytes(m) - tensor_page_bytes(m.base) for m in model.modules() if isinstance(m, Adapted))
    budget = max(streaming_budget(model), 32 * adapters)
    assert budget < tensor_page_bytes(model)
    pager.wrap(model, budget=budget, device="cpu")
    pg = pager.of(model)
    assert not any(b.trainable for b in pg.blocks) and all(set(b.segments) == {"weights"} for b in pg.blocks)
    opt, ref_opt = OPTIMIZERS["adamw"](trainable(model)), OPTIMIZERS["adamw"](trainable(ref))
    train(model, opt, batches(5))
    train(ref, ref_opt, batches(5))
    s = pg.stats()
    assert s.evictions > 0 and s.d2h_bytes == 0 and not written
    assert s.peak_resident_bytes <= budget
    pager.unwrap(model)
    assert_params_equal(model, ref)


def test_a_block_all_frozen_or_all_trainable_keeps_one_page():
    model = TinyLM()
    model.layers[0].requires_grad_(False)
    pager.wrap(model, budget=1 << 30, device="cpu")
    assert all(set(b.segments) <= {"weights", "grads", "state"} for b in pager.of(model).all_blocks())


def test_frozen_compressed_pages_keep_their_encoding_through_training(caplog):
    model = adapted_lm(torch.bfloat16)
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=streaming_budget(model), device="cpu", compress="lossless")
    pg = pager.of(model)
    compressed = pg.stats().compressed_blocks
    assert compressed == len(model.layers)
    opt, ref_opt = OPTIMIZERS["adamw"](trainable(model)), OPTIMIZERS["adamw"](trainable(ref))
    with caplog.at_level(logging.WARNING, logger="pager"):
        train(model, opt, batches(4))
        train(ref, ref_opt, batches(4))
        for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):  # (updates deferred)
            assert torch.equal(a, b), name
        train(model, opt, batches(2))
        train(ref, ref_opt, batches(2))
    s = pg.stats()
    assert s.evictions > 0 and s.compressed_blocks == compressed
    assert "compressed page is replaced" not in caplog.text
    pager.unwrap(model)
    assert_params_equal(model, ref)


@pytest.mark.parametrize("codec", ["int4", "fp8"])
def test_lossy_frozen_pages_train_like_the_model_with_their_decoded_weights(codec):
    """QLoRA's saving without the base model on the device: the frozen
    weights stream compressed and are decoded at each use; training equals
    the unwrapped model holding the decoded weights."""
    model = adapted_lm(torch.bfloat16)
    pager.wrap(model, budget=streaming_budget(model), device="cpu", compress=codec)
    ref = adapted_lm(torch.bfloat16)
    ref.load_state_dict(model.state_dict())  # the frozen weights as the pages decode them
    opt, ref_opt = OPTIMIZERS["adamw"](trainable(model)), OPTIMIZERS["adamw"](trainable(ref))
    train(model, opt, batches(4))
    train(ref, ref_opt, batches(4))
    assert pager.of(model).stats().compressed_blocks == len(model.layers)
    assert_params_equal(model, ref)


def test_unfreezing_a_frozen_parameter_after_wrap_is_refused():
    model = adapted_lm()
    pager.wrap(model, budget=streaming_budget(model), device="cpu")
    model.layers[1].attn.qkv.base.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"'layers.1.attn.qkv.base.weight' was frozen at wrap.*unwrap"):
        lm_loss(model, *batches(1)[0]).backward()


# ------------------------------------------------------------------ peft
def peft_llama(targets, hidden=128, layers=4, dtype=torch.float32, seed=0):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(config).to(dtype)
    lora = peft.LoraConfig(r=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(base, lora)


def peft_train(model, opt, steps, accumulate=2, first=0, device="cpu"):
    """`steps` steps of `accumulate` batches each, from step `first` on (the same batches for the same steps)."""
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(step)
        for _micro in range(accumulate):
            ids = torch.randint(0, 256, (2, 16), generator=g).to(device)
            model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable(model), 1.0)
        opt.step()
        opt.zero_grad()


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ALL], ids=["q,v", "attention+mlp"])
@pytest.mark.parametrize("activations", ["keep", "recompute"])
def test_peft_lora_trains_bit_for_bit_under_a_streaming_budget(targets, activations, monkeypatch):
    model = peft_llama(targets)
    ref = copy.deepcopy(model)
    written = written_back_by_kind(monkeypatch)
    total = tensor_page_bytes(model)
    pager.wrap(model, budget=int(0.7 * total), device="cpu", activations=activations)
    opt = torch.optim.AdamW(trainable(model), lr=1e-3)
    ref_opt = torch.optim.AdamW(trainable(ref), lr=1e-3)
    peft_train(model, opt, 1)
    pager.of(model).reset()  # (the first pass learns what the activations need: see [Note: one budget])
    peft_train(model, opt, 2, first=1)
    peft_train(ref, ref_opt, 3)
    s = pager.of(model).stats()
    assert s.evictions > 0 and "frozen" not in written
    if activations == "recompute":  # blocks and activations under the budget together
        assert s.peak_device_bytes <= pager.of(model).budget_bytes
    pager.unwrap(model)
    assert_params_equal(model, ref)


@pytest.mark.parametrize("activations", ["keep", "recompute"])
def test_peft_lora_on_split_layers_holds_the_budget_in_backward(activations):
    """Layers too large for the budget are split into their projections
    ([Note: splitting large blocks]): the frozen base layers are held by the
    backward only until their input's gradient is computed, so a budget that
    holds a few of them trains (it raised BudgetError when they were held to
    the end of the backward)."""
    model = peft_llama(ATTENTION, hidden=512)
    ref = copy.deepcopy(model)
    budget = int(0.45 * tensor_page_bytes(model))
    pager.wrap(model, budget=budget, device="cpu", activations=activations)
    pg = pager.of(model)
    assert any(b.name.endswith("q_proj.base_layer") for b in pg.blocks)  # split
    opt = torch.optim.AdamW(trainable(model), lr=1e-3)
    ref_opt = torch.optim.AdamW(trainable(ref), lr=1e-3)
    peft_train(model, opt, 1, accumulate=1)
    pg.reset()  # (the first pass learns what the activations need: see [Note: one budget])
    peft_train(model, opt, 1, accumulate=1, first=1)
    peft_train(ref, ref_opt, 2, accumulate=1)
    s = pg.stats()
    assert s.peak_resident_bytes <= budget and s.d2h_bytes == 0  # (the adapters stay on the device)
    if activations == "recompute":  # blocks and activations under the budget together
        assert s.peak_device_bytes <= budget
    pager.unwrap(model)
    assert_params_equal(model, ref)


def test_linears_inside_a_recomputed_layer_keep_no_inputs_of_their_own():
    """Split layers under recompute: each frozen linear, a block inside its
    layer's, is recomputed with the layer ([Note: blocks inside a recomputed
    block]): between forward and backward the ledger holds the layers'
    inputs and what ops outside blocks save, not each linear's input (the
    very activation it saves); what the plan predicts bounds the pass, and
    the adapters train bit for bit."""
    model = peft_llama(ATTENTION, hidden=512)
    ref = copy.deepcopy(model)
    budget = int(0.45 * tensor_page_bytes(model)) + (9 << 20)  # (blocks, and the activations of 2x128 tokens)
    pager.wrap(model, budget=budget, device="cpu", activations="recompute", budget_covers="pager")
    pg = pager.of(model)
    assert sum(b.name.endswith("q_proj.base_layer") for b in pg.blocks) == 4  # (split)
    opt, ref_opt = (torch.optim.AdamW(trainable(m), lr=1e-3) for m in (model, ref))
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(2):
            loss = m(input_ids=ids, labels=ids).loss
            if m is model:
                live = pg.activations.ledger.live
            loss.backward()
            o.step()
            o.zero_grad()
    sb = pg.activations.planned
    layers = [i for i, n in enumerate(sb.names) if n.endswith(tuple(f"layers.{k}" for k in range(4)))]
    assert sorted(sb.recomputed_groups(sb._rest(()))) == layers
    assert live == sum(sb.inputs[i] for i in layers) + sb.outside
    s = pg.stats()
    assert s.recomputes == 2 * 4  # (the layers' own: the linears ran again inside them)
    assert s.peak_activation_bytes <= sb.peak("recompute", min_bytes=0, copies=False)
    pager.unwrap(model)
    assert_params_equal(model, ref)


def test_peft_adapters_save_and_load(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft_llama(ALL)
    pager.wrap(model, budget=int(0.6 * tensor_page_bytes(model)), device="cpu")
    opt = torch.optim.AdamW(trainable(model), lr=1e-3)
    peft_train(model, opt, 2)
    model.save_pretrained(tmp_path / "adapter")  # while wrapped
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    base = peft_llama(ALL).unload()  # the same base weights (same seed), without adapters
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, want)
