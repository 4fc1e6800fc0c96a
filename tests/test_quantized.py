"""Quantized (wrapper-subclass) weights ([Note: wrapper-subclass weights] in
base/wrappers.py): paged by their inner tensors, keeping identity, class and
their own kernels; equal to the unwrapped quantized model bit for bit on the
CPU device, in inference, LoRA training, state dicts, compile, threads; and
what pager cannot page is refused at wrap. With `QuantizedWeight` (written
out in tests/quantized.py) and, where installed, torchao's int8 weights."""

import logging
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from quantized import QuantizedWeight, quantize, quantized_bytes
from test_activations import activations_room
from test_adapters import written_back_by_kind

import pager
from pager.base.wrappers import nbytes_of


class Layer(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def stack(seed=0, n=6, d=64):
    torch.manual_seed(seed)
    return quantize(nn.Sequential(*(Layer(d) for _ in range(n))))


def streaming_budget(model, layers=2.5):
    return int(layers * quantized_bytes(model[0]))


def inputs(seed=0, d=64):
    return torch.randn(4, d, generator=torch.Generator().manual_seed(seed))


def forward(model, x):
    with torch.no_grad():
        return model(x)


def test_quantized_weights_stream_by_their_bytes_bit_for_bit():
    model, ref = stack(), stack()
    weight = model[0].up.weight
    pager.wrap(model, budget=streaming_budget(model), device="cpu")
    pg = pager.of(model)
    for seed in range(3):
        assert torch.equal(forward(model, inputs(seed)), forward(ref, inputs(seed)))
    s = pg.stats()
    assert s.evictions > 0 and s.d2h_bytes == 0
    # The pages hold the int8 values and scales: a quarter of the float weights and a little.
    assert pg.engine.total_bytes == quantized_bytes(ref) < sum(p.numel() * 4 for p in ref.parameters()) / 2
    assert model[0].up.weight is weight and isinstance(weight, nn.Parameter) and isinstance(weight, QuantizedWeight)
    assert not weight.requires_grad and weight.shape == (128, 64) and weight.dtype == torch.float32


def test_plan_sizes_quantized_weights_by_their_bytes():
    model = stack()
    plan = pager.plan(model, budget=streaming_budget(model), compress="int4")
    assert [nbytes for _name, nbytes in plan.blocks] == [quantized_bytes(layer) for layer in model]
    # int4 would code float matrices; quantized weights stay as they are, and nothing else here is a matrix
    streamed = [layer for name, layer in zip((n for n, _b in plan.blocks), model) if name not in plan.kept]
    assert streamed and plan.forward_bytes == sum(nbytes_of(t) for layer in streamed for t in layer.parameters())


def test_a_paged_out_quantized_weight_is_served():
    model, ref = stack(), stack()
    pager.wrap(model, budget=streaming_budget(model), device="cpu")
    forward(model, inputs())
    w = model[0].up.weight  # paged out by now
    assert torch.equal(w.dequantize(), ref[0].up.weight.dequantize())
    assert torch.equal(F.linear(inputs(), w), F.linear(inputs(), ref[0].up.weight))
    assert repr(w).startswith("QuantizedWeight(")
    with torch.no_grad():
        w.copy_(QuantizedWeight.of(torch.ones(128, 64)))  # a served write: the page is written back
    forward(model, inputs())
    assert torch.equal(model[0].up.weight.dequantize(), torch.ones(128, 64))


def test_assigning_data_of_a_paged_out_quantized_weight_is_refused():
    """`w.data = other` would change the wrapper's sizes while its page kept
    the old bytes (and the forward read them): refused, as a plain weight's
    is; `w.data = w` (`module.to()` to where it is) changes nothing."""
    model, ref = stack(), stack()
    pager.wrap(model, budget=streaming_budget(model), device="cpu")
    forward(model, inputs())
    w = model[0].up.weight  # paged out by now
    with pytest.raises(RuntimeError, match="assigning `.data` of .* outside its block's use"):
        w.data = QuantizedWeight.of(torch.randn(64, 64))
    w.data = w
    assert w.shape == (128, 64) and torch.equal(forward(model, inputs()), forward(ref, inputs()))


def test_state_dicts_of_quantized_weights_are_host_copies_and_load_back():
    model, other = stack(), stack(seed=1)
    pager.wrap(model, budget=streaming_budget(model), device="cpu")
    forward(model, inputs())
    pg = pager.of(model)
    pg.reset()
    state = model.state_dict()
    assert pg.stats().misses == 0  # nothing fetched to make it
    for name, value in other.state_dict().items():
        assert type(state[name]) is type(value), name
        if isinstance(value, QuantizedWeight):
            assert torch.equal(state[name].qdata, stack().state_dict()[name].qdata)
            assert state[name].qdata.untyped_storage().data_ptr() != model.get_parameter(name).qdata.data_ptr()
    model.load_state_dict(other.state_dict())
    assert torch.equal(forward(model, inputs()), forward(other, inputs()))


def test_unwrap_gives_quantized_weights_back_as_they_were():
    model, ref = stack(), stack()
    weight = model[2].down.weight
    pager.wrap(model, budget=streaming_budget(model), device="cpu")
    forward(model, inputs())
    pager.unwrap(model)
    assert model[2].down.weight is weight and type(weight) is QuantizedWeight
    assert type(weight.qdata) is torch.Tensor and weight.qdata.device.type == "cpu"
    assert torch.equal(forward(model, inputs()), forward(ref, inputs()))


class Adapted(nn.Module):
    """A quantized linear layer, frozen, with a trainable low-rank update (QLoRA)."""

    def __init__(self, d=64, rank=4):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.a = nn.Parameter(torch.randn(rank, d) * 0.1)
        self.b = nn.Parameter(torch.randn(d, rank) * 0.1)

    def forward(self, x):
        return F.gelu(self.base(x) + F.linear(F.linear(x, self.a), self.b))


def adapted(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(*(Adapted() for _ in range(6)))
    for m in model:
        m.base.weight = nn.Parameter(QuantizedWeight.of(m.base.weight), requires_grad=False)
        m.base.bias.requires_grad_(False)
    return model


def adapters_budget(model, activations="auto"):
    """2.5 blocks' quantized pages with their adapters' gradients and state,
    and room for what activations hold under `activations` (the budget
    bounds them too: none for "keep")."""
    blocks = int(2.5 * quantized_bytes(model[0]))
    if activations == "keep":
        return blocks
    return blocks + activations_room(model, inputs(), activations, min_bytes=1 << 20)


def train(model, opt, steps, clip=True):
    for step in range(steps):
        for micro in range(2):
            model(inputs(10 * step + micro)).pow(2).mean().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("activations", ["keep", "recompute", "offload"])
def test_adapters_on_quantized_weights_train_bit_for_bit(activations, monkeypatch, caplog):
    model, ref = adapted(), adapted()
    written = written_back_by_kind(monkeypatch)
    pager.wrap(model, budget=adapters_budget(model, activations), device="cpu", activations=activations)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    with caplog.at_level(logging.WARNING, logger="pager"):
        train(model, opt, 3)
    train(ref, ref_opt, 3)
    assert pager.of(model).stats().evictions > 0
    assert "frozen" not in written  # the quantized page never changes
    assert "kept from its forward" not in caplog.text  # what autograd saves of them is counted, not a user's view
    assert torch.equal(forward(model, inputs(99)), forward(ref, inputs(99)))
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        if a.requires_grad:
            assert torch.equal(a, b), name


def test_compress_leaves_quantized_weights_as_they_are():
    """Their scales are float matrices a lossy codec would code again: they stay raw, the model's other
    matrices are coded."""
    model, ref = stack(d=256, n=4), stack(d=256, n=4)
    for m in (model, ref):
        m.append(nn.Linear(256, 256))  # a weight left unquantized
    pager.wrap(model, budget=streaming_budget(model, 2), device="cpu", compress="int4")
    pg = pager.of(model)
    quantized_segs = [b.weights for b in pg.blocks if b.quantized]
    assert quantized_segs and all(
        seg.encoded is None or all(piece.kind == "raw" for piece in seg.encoded.pieces) for seg in quantized_segs
    )
    assert any(b.weights.encoded is not None for b in pg.blocks if not b.quantized)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    assert torch.equal(forward(model[:4], x), forward(ref[:4], x))


def test_quantized_weights_under_another_thread():
    """The shared mode ([Note: tensors and threads]): a block in use keeps its
    guards; its thread runs the weights' kernels unserved (no block held twice)."""
    model, ref = adapted(), adapted()
    budget = adapters_budget(model, "recompute")
    pager.wrap(model, budget=budget, device="cpu", activations="recompute")
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert torch.equal(forward(model, inputs()), forward(ref, inputs()))
        # (no clipping: its norms of paged-out gradients are served in this mode, fetching their blocks)
        train(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2), 2, clip=False)
        train(ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2), 2, clip=False)
        assert torch.equal(forward(model, inputs(9)), forward(ref, inputs(9)))
        s = pager.of(model).stats()
        assert pager.of(model).shared_mode and s.on_demand == 0 and s.peak_resident_bytes <= budget
    finally:
        stop.set()
        other.join()


@pytest.mark.parametrize("how", ["blocks", "whole"])
def test_quantized_blocks_compile(how):
    compiles_like_unwrapped(how)


@pytest.mark.parametrize("how", ["blocks", "whole"])
def test_quantized_blocks_compile_in_the_shared_mode(how):
    """Issue 62: with another thread of the user's (a request server, a loader
    thread) a weight in use keeps its guard class, and torch.compile fakeifies it as
    such ([Note: guard-class wrappers pager did not guard] in base/guards.py)."""
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        pg = compiles_like_unwrapped(how)
        assert pg.shared_mode and pg.stats().on_demand == 0
    finally:
        stop.set()
        other.join()


def compiles_like_unwrapped(how):
    """Compiled by blocks or whole, the paged model gives the compiled
    unwrapped one's results bit for bit, and nothing compiles again as blocks
    page. Returns the model's Pager."""
    dynamo = pytest.importorskip("torch._dynamo")
    from torch._dynamo.testing import CompileCounterWithBackend

    dynamo.reset()
    model, ref = stack(), stack()
    counter = CompileCounterWithBackend("aot_eager")
    if how == "blocks":
        for layer in model:
            layer.compile(backend=counter)
        for layer in ref:
            layer.compile(backend="aot_eager")
    pager.wrap(model, budget=streaming_budget(model), device="cpu")
    pg = pager.of(model)
    if how == "whole":
        model, ref = torch.compile(model, backend=counter), torch.compile(ref, backend="aot_eager")
    forward(model, inputs())
    frames = counter.frame_count
    for seed in range(3):
        assert torch.equal(forward(model, inputs(seed)), forward(ref, inputs(seed)))
    assert counter.frame_count == frames  # nothing compiled again as blocks page
    dynamo.reset()
    return pg


def test_a_guarded_quantized_weight_prints_in_the_shared_mode():
    """Paged out, in use by this thread (still guarded: printing it opens its
    block to no other thread), and as torch.compile's fake of it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, ref = stack(), stack()
    pager.wrap(model, budget=streaming_budget(model), device="cpu")
    printed = {}

    def in_use(m, args):
        printed["in use"] = repr(m.weight)
        printed["class after"] = type(m.weight).__name__
        printed["fake"] = repr(FakeTensorMode().from_tensor(m.weight))

    model[1].up.register_forward_pre_hook(in_use)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        forward(model, inputs())
        assert pager.of(model).shared_mode
        paged_out = model[1].up.weight
        assert type(paged_out).__name__ == "GuardedQuantizedWeight"
        assert repr(paged_out) == printed["in use"] == repr(ref[1].up.weight)
        assert printed["class after"] == "GuardedQuantizedWeight"
        assert printed["fake"].startswith("QuantizedWeight(qdata=FakeTensor(")
    finally:
        stop.set()
        other.join()


def test_only_views_let_go_at_unwrap_are_refused():
    """A wrapper of a guard class that pager did not guard (a copy made in a
    use in the shared mode) is no orphan; a view of a page kept across
    `pager.unwrap` is, with a clear error."""
    model, ref = stack(), stack()
    pager.wrap(model, budget=streaming_budget(model), device="cpu")
    copies = []
    model[0].up.register_forward_pre_hook(lambda m, args: copies.append(m.weight.clone()))
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        forward(model, inputs())
        view = model[0].up.weight.detach()  # paged out by now: a view of its page
    finally:
        stop.set()
        other.join()
    expected = F.linear(inputs(), ref[0].up.weight)
    assert type(copies[0]).__name__ == "GuardedQuantizedWeight"
    assert torch.equal(F.linear(inputs(), view), expected)
    pager.unwrap(model)
    assert torch.equal(F.linear(inputs(), copies[0]), expected) and repr(copies[0]).startswith("QuantizedWeight(")
    with pytest.raises(RuntimeError, match="unwrap"):
        F.linear(inputs(), view)
    with pytest.raises(RuntimeError, match="unwrap"):
        repr(view)


def test_a_view_a_weights_kernel_made_in_a_use_is_tracked_with_its_page():
    """In the shared mode a weight in use keeps its guard class, so its own
    kernels return views of its page in that class (`aten.detach` in a hook).
    Such a view is tracked with the page: used later it is served (equal to
    the unwrapped weight, no recursion), and after `pager.unwrap`, when the
    page's storage has gone, it refuses with the clear error (it had read a
    storage of no bytes: a crash)."""
    model, ref = stack(), stack()
    pager.wrap(model, budget=streaming_budget(model), device="cpu")
    kept = []
    model[0].down.register_forward_pre_hook(lambda m, args: kept.append(torch.ops.aten.detach.default(m.weight)))
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        forward(model, inputs())
        assert pager.of(model).shared_mode and type(kept[0]).__name__ == "GuardedQuantizedWeight"
        x = torch.randn(2, kept[0].shape[1])
        assert torch.equal(F.linear(x, kept[0]), F.linear(x, ref[0].down.weight))
    finally:
        stop.set()
        other.join()
    pager.unwrap(model)
    with pytest.raises(RuntimeError, match="unwrap"):
        F.linear(x, kept[0])
    with pytest.raises(RuntimeError, match="unwrap"):
        repr(kept[0])


class Opaque(torch.Tensor):
    """A subclass with its own dispatch and no __tensor_flatten__: its bytes cannot be found."""

    @staticmethod
    def __new__(cls, t):
        return torch.Tensor._make_wrapper_subclass(cls, t.shape, dtype=t.dtype, device=t.device)

    def __init__(self, t):
        self.t = t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return cls(args[0].t)
        raise NotImplementedError


class Nested(QuantizedWeight):
    pass


@pytest.mark.parametrize("case", ["opaque", "trainable", "nested"])
def test_a_subclass_pager_cannot_page_is_refused_before_anything_changes(case):
    model = stack()
    lin = model[1].up
    if case == "opaque":
        lin.weight = nn.Parameter(Opaque(torch.zeros(128, 64)), requires_grad=False)
        wanted = "Opaque.*__tensor_flatten__"
    elif case == "trainable":
        lin.weight.requires_grad_(True)
        wanted = "QuantizedWeight.*requires grad.*requires_grad_\\(False\\)"
    else:
        inner = QuantizedWeight.of(torch.randn(128, 64))
        lin.weight = nn.Parameter(
            Nested(inner.qdata, QuantizedWeight.of(inner.scale.repeat(1, 8)), torch.float32), requires_grad=False
        )
        wanted = "Nested.*inner tensor 'scale'"
    before = [type(p) for p in model.parameters()]
    with pytest.raises(ValueError, match=wanted):
        pager.wrap(model, budget=streaming_budget(stack()), device="cpu")
    assert [type(p) for p in model.parameters()] == before
    assert all(p.device.type == "cpu" and not p.is_meta for p in model.parameters())


def test_save_refuses_quantized_weights_with_the_fix(tmp_path):
    model = stack()
    pager.wrap(model, budget=streaming_budget(model), device="cpu")
    with pytest.raises(ValueError, match=r"'0.up.weight'.*QuantizedWeight.*torch.save\(model.state_dict"):
        pager.save(model, tmp_path / "model.safetensors")
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- torchao
def torchao_int8(seed=0, **kw):
    quantization = pytest.importorskip("torchao.quantization")
    model = stack(seed, **kw)
    for m in model.modules():  # back to plain weights: torchao quantizes them itself
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(m.weight.dequantize())
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    return model


def test_torchao_int8_weights_stream_bit_for_bit():
    model, ref = torchao_int8(), torchao_int8()
    weight = model[0].up.weight
    cls = type(weight)
    pager.wrap(model, budget=streaming_budget(model), device="cpu")
    for seed in range(3):
        assert torch.equal(forward(model, inputs(seed)), forward(ref, inputs(seed)))
    assert pager.of(model).stats().evictions > 0
    assert torch.equal(model.state_dict()["1.down.weight"].dequantize(), ref[1].down.weight.dequantize())
    pager.unwrap(model)
    assert model[0].up.weight is weight and type(weight) is cls
    assert torch.equal(forward(model, inputs()), forward(ref, inputs()))


def test_torchao_int8_base_trains_adapters_bit_for_bit():
    quantization = pytest.importorskip("torchao.quantization")

    def make():
        model = adapted()
        for m in model:
            m.base.weight = nn.Parameter(m.base.weight.dequantize())
        quantization.quantize_(
            model, quantization.Int8WeightOnlyConfig(), filter_fn=lambda m, _fqn: isinstance(m, nn.Linear)
        )
        return model

    model, ref = make(), make()
    pager.wrap(model, budget=adapters_budget(model, "recompute"), device="cpu", activations="recompute",
               budget_covers="pager")  # (sized for blocks and activations, pager's own)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    train(model, opt, 2)
    train(ref, ref_opt, 2)
    assert torch.equal(forward(model, inputs(99)), forward(ref, inputs(99)))
