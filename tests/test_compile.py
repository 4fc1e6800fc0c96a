"""pager under torch.compile ([Note: pager under torch.compile] in
model/hooks.py): blocks compiled by themselves (`module.compile()`) and the
whole model (`torch.compile(model)`), inference and training, equal to the
unwrapped model compiled the same way, with no recompilation once the first
steps have run, while blocks page in and out."""

import copy
import shutil

import pytest
import torch
import torch.nn.functional as F

import pager
from helpers import tensor_page_bytes
from models import TinyLM
from test_training import batches

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    dynamo.reset()  # (compiled code and its cache limits are per process)
    yield
    dynamo.reset()


def streaming_budget(model, training=True):
    """Room for three layers (with their gradients and Adam's state in `training`): they stream."""
    layer = tensor_page_bytes(model.layers[0])
    remainder = tensor_page_bytes(model) - len(model.layers) * layer
    return (4 if training else 1) * (remainder + 3 * layer)


def compiled(model, how, backend):
    """`model` compiled `how` ("blocks": each layer by itself; "whole"), and its counter of compiled frames."""
    counter = CompileCounterWithBackend(backend)
    if how == "blocks":
        for layer in model.layers:
            layer.compile(backend=counter)
        return model, counter
    return torch.compile(model, backend=counter), counter


def pair(how, backend="aot_eager", regime="streams", training=True, **wrap):
    """A wrapped TinyLM and its unwrapped twin, both compiled `how`."""
    model = TinyLM(d=64)
    ref = copy.deepcopy(model)
    budget = 1 << 30 if regime == "fits" else streaming_budget(model, training)
    if how == "blocks":  # (before wrap: FSDP2's order; after wrap works as well)
        model, counter = compiled(model, how, backend)
        pager.wrap(model, budget=budget, device="cpu", **wrap)
    else:
        pager.wrap(model, budget=budget, device="cpu", **wrap)
        model, counter = compiled(model, how, backend)
    ref, _ = compiled(ref, how, backend)
    return model, ref, counter


def train_steps(model, ref, steps, counter):
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    frames = []
    for ids, tgt in batches(steps):
        for m, o in ((model, opt), (ref, ref_opt)):
            F.cross_entropy(m(ids).flatten(0, 1), tgt.flatten()).backward()
            o.step()
            o.zero_grad()
        frames.append(counter.frame_count)
    return frames


def unwrapped(model):
    return getattr(model, "_orig_mod", model)


def assert_equal_models(model, ref):
    pager.unwrap(unwrapped(model))
    for (name, a), b in zip(unwrapped(model).state_dict().items(), unwrapped(ref).state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("how", ["blocks", "whole"])
@pytest.mark.parametrize("regime", ["streams", "fits"])
def test_compiled_inference_equals_the_compiled_model(how, regime):
    model, ref, counter = pair(how, regime=regime, training=False)
    frames = []
    with torch.no_grad():
        for ids, _tgt in batches(5):
            assert torch.equal(model(ids), ref(ids))
            frames.append(counter.frame_count)
    assert frames[-1] >= 1 and frames[-1] == frames[1]  # compiled, and not again as blocks come and go
    if regime == "streams":
        assert pager.of(unwrapped(model)).stats().evictions > 0


@pytest.mark.parametrize("how,activations,placement", [
    ("blocks", "keep", "device"), ("blocks", "keep", "host"), ("blocks", "offload", "auto"),
    ("blocks", "recompute", "auto"), ("whole", "keep", "device"), ("whole", "keep", "auto")])
def test_compiled_training_equals_the_compiled_model(how, activations, placement):
    model, ref, counter = pair(how, activations=activations, optimizer_step=placement)
    frames = train_steps(model, ref, 6, counter)
    assert frames[-1] >= 1 and frames[-1] == frames[2], frames
    s = pager.of(unwrapped(model)).stats()
    # (updates deferred to the blocks' next use, or run on the host: [Note: the optimizer step on the host])
    assert s.evictions > 0 and (s.deferred_steps > 0 if placement == "device" else s.host_steps > 0)
    if activations == "recompute":
        assert s.recomputes > 0
    assert_equal_models(model, ref)


def test_a_compiled_block_is_one_graph_as_unwrapped():
    graphs = {}

    def counting(name):
        def backend(gm, example_inputs):
            graphs.setdefault(name, []).append(len(gm.graph.nodes))
            return gm.forward
        return backend

    for name in ("bare", "wrapped"):
        dynamo.reset()
        model, backend = TinyLM(d=64), counting(name)
        for layer in model.layers:
            layer.compile(backend=backend)
        if name == "wrapped":
            pager.wrap(model, budget=streaming_budget(model, training=False), device="cpu")
        with torch.no_grad():
            for ids, _tgt in batches(3):
                model(ids)
    # One graph, shared by the layers (same code, same shapes), as without pager.
    assert graphs["wrapped"] == graphs["bare"] and len(graphs["bare"]) == 1


def test_whole_model_compile_with_activations_under_the_budget_is_refused_clearly():
    model, _ref, _counter = pair("whole", activations="recompute")
    ids, tgt = batches(1)[0]
    with pytest.raises(RuntimeError, match=r"torch.compile of the whole model.*module.compile\(\)"):
        F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten()).backward()


def test_whole_model_compile_under_the_default_activations_keeps_them_and_says_so(caplog):
    """activations="auto" (the default) cannot offload or recompute under
    `torch.compile(model)`: it keeps every block's activations, counted under
    the budget, says so once, and trains as the compiled model."""
    model, ref, counter = pair("whole", optimizer_step="device")
    with caplog.at_level("WARNING", logger="pager"):
        frames = train_steps(model, ref, 6, counter)
    assert frames[-1] >= 1 and frames[-1] == frames[2], frames
    s = pager.of(unwrapped(model)).stats()
    assert s.activations_kept_blocks == len(unwrapped(model).layers) and s.recomputes == 0
    assert s.activations_sent_bytes == 0 and s.peak_activation_bytes > 0 and s.evictions > 0
    assert caplog.text.count("keeps them all on the device") == 1
    assert_equal_models(model, ref)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_inductor_compiled_blocks_train_like_the_compiled_model():
    model, ref, counter = pair("blocks", backend="inductor")
    frames = train_steps(model, ref, 4, counter)
    assert frames[-1] == frames[2]
    assert_equal_models(model, ref)


# ------------------------------------------------------------ tensor subclasses
def test_a_trainable_weight_that_wraps_other_tensors_is_refused_before_anything_changes():
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    model = TinyLM(d=32)
    w = model.layers[1].attn.proj.weight
    model.layers[1].attn.proj.weight = torch.nn.Parameter(two_tensor.TwoTensor(w.detach().clone(), w.detach().clone()))
    before = {n: (t, t.device) for n, t in model.state_dict(keep_vars=True).items()}
    wanted = r"'layers.1.attn.proj.weight' is a .*TwoTensor.*requires grad.*requires_grad_\(False\)"
    with pytest.raises(ValueError, match=wanted):
        pager.wrap(model, budget=1 << 20, device="cpu")
    assert {n: (t, t.device) for n, t in model.state_dict(keep_vars=True).items()} == before
    assert not hasattr(model, "_forward_pre_hooks") or not model._forward_pre_hooks
