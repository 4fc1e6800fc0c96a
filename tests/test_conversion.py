"""Checkpoints in another layout than the model's: mixture-of-experts
folders saved with one tensor per expert (as transformers 5's own
`save_pretrained` writes them) load into its fused expert parameters, read
in place from the files ([Note: checkpoint conversions as byte ranges] in
api/conversion.py)."""

import json

import pytest
import torch

import pager
from pager.api import conversion
from pager.base.files import Entry

transformers = pytest.importorskip("transformers")


def _mixtral():
    return transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )


def _qwen3_moe():  # a dense layer between MoE ones
    return transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=6,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        max_position_embeddings=64,
    )


def _deepseek_v3():  # a dense first layer; multi-head latent attention
    return transformers.DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=64,
    )


CONFIGS = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}


def _saved(tmp_path, kind, safe=True):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]())
    folder = tmp_path / kind
    model.save_pretrained(folder, safe_serialization=safe, max_shard_size="40KB")
    return folder


def _nbytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _budget(model) -> int:
    """The rest of the model and one and a half of its largest layer: the layers stream."""
    layers = model.model.layers
    return _nbytes(model) - sum(_nbytes(m) for m in layers) + 3 * max(_nbytes(m) for m in layers) // 2


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "torch-save"])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_experts_saved_one_tensor_each_load_fused_bit_for_bit(tmp_path, kind, safe):
    folder = _saved(tmp_path, kind, safe)
    if safe:  # (what the test is about: the files name each expert's projections)
        names = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        assert any(".experts.0." in n for n in names) and not any(n.endswith("gate_up_proj") for n in names)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    # (experts=None: the experts page with their layers, from the files; by expert they are read whole)
    model = pager.from_pretrained(folder, budget=_budget(ref), device="cpu", experts=None)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(ids).logits, ref(ids).logits)
    assert pager.of(model).stats().misses > 2  # the layers streamed
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
    i = next(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    experts = model.model.layers[i].mlp.experts
    pieces = pager.of(model).sources[id(experts.gate_up_proj)]
    assert 1 < len(pieces) <= 2 * experts.gate_up_proj.shape[0]  # (an expert's gate and up are neighbours in a file)
    assert sum(p.nbytes for p in pieces) == experts.gate_up_proj.numel() * experts.gate_up_proj.element_size()
    pager.unwrap(model)
    assert torch.equal(experts.gate_up_proj, ref.model.layers[i].mlp.experts.gate_up_proj)


def test_fused_experts_read_through_a_host_budget(tmp_path):
    """Under a host budget the pieces of a fused parameter are read from the
    files into its page by the disk tier, like any tensor's."""
    folder = _saved(tmp_path, "qwen3_moe")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    layer = max(_nbytes(m) for m in ref.model.layers)
    model = pager.from_pretrained(folder, budget=_budget(ref), host_budget=2 * layer + 4096, device="cpu", experts=None)
    ids = torch.randint(0, 64, (3, 5))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(ids).logits, ref(ids).logits)
    assert pager.of(model).stats().disk_read_bytes > _nbytes(ref)


def _entry(name, t):
    return Entry(name, t.dtype, tuple(t.shape), tensor=t)


def _bytes(pieces) -> torch.Tensor:
    return torch.cat([p.tensor.reshape(-1).view(torch.uint8) for p in pieces])


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_stacked_and_concatenated_stand_ins_are_the_bytes_torch_makes(dim):
    """What stack (on the first dimension) and cat (on any) make of the
    stand-ins is, range by range, what they make of the tensors."""
    torch.manual_seed(0)
    gates = [torch.randn(5, 3) for _ in range(4)]
    ups = [torch.randn(5, 3) for _ in range(4)]
    stand = {
        n: conversion._Ranges(t.shape, t.dtype, [(_entry(n, t), 0, t.numel() * 4)])
        for n, t in [*((f"g{i}", t) for i, t in enumerate(gates)), *((f"u{i}", t) for i, t in enumerate(ups))]
    }
    g = torch.stack([stand[f"g{i}"] for i in range(4)])
    u = torch.stack([stand[f"u{i}"] for i in range(4)])
    made = torch.cat([g, u], dim=dim)
    want = torch.cat([torch.stack(gates), torch.stack(ups)], dim=dim)
    assert made.shape == want.shape and isinstance(made, conversion._Ranges)
    pieces = [conversion._piece("x", *run) for run in made.runs]
    assert torch.equal(_bytes(pieces), want.reshape(-1).view(torch.uint8))


def test_a_conversion_that_needs_the_bytes_is_refused_naming_it():
    """A transpose (or any operation but stacking and concatenating) would
    need the bytes themselves: refused, naming the tensor and the way out."""
    from types import SimpleNamespace

    from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter

    converter = WeightConverter(
        "mlp.experts.*.w.weight", "mlp.experts.w", operations=[MergeModulelist(dim=0), Transpose(1, 2)]
    )
    sources = []
    for i in range(3):
        t = torch.randn(4, 2)
        key = f"mlp.experts.{i}.w.weight"
        converter.add_tensor(
            "mlp.experts.w",
            key,
            "mlp.experts.*.w.weight",
            lambda t=t, key=key: conversion._Ranges(t.shape, t.dtype, [(_entry(key, t), 0, 32)]),
        )
        sources.append(key)
    with pytest.raises(ValueError, match=r"'mlp.experts.w'.*MergeModulelist, Transpose.*not transpose.*pager.wrap"):
        conversion._run(SimpleNamespace(config=None), "mlp.experts.w", converter, sources)


def test_a_model_that_is_not_transformers_keeps_the_checkpoints_names():
    entries = {"w": _entry("w", torch.ones(2))}
    assert conversion.convert(torch.nn.Linear(2, 2), entries, {}) == (entries, {})
