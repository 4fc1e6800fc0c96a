"""What a new user met (issue 71): a device pager does not run on, a budget
larger than the device, a wrapped model pickled or deep-copied, and a bad
`activations=`: each a clear error naming the value and the fix, before
anything changes."""

import copy
import io
import pickle

import psutil
import pytest
import torch

import pager
import pager.base.budget as budget_mod
from helpers import assert_models_equal, assert_same
from models import Layer, TinyLM
from test_reliability import assert_untouched, consistent, snapshot
from test_training import batches, lm_loss, regime_budget


# ------------------------------------------------------------ the device
@pytest.mark.parametrize(
    "device, match",
    [
        ("cpu:1", r"device='cpu:1' names a CPU index.*pass device=\"cpu\""),
        (torch.device("cpu", 3), r"device=device\(type='cpu', index=3\) names a CPU index.*pass device=\"cpu\""),
        ("meta", r"device='meta' is not supported.*use \"cuda\", \"cuda:0\" or \"cpu\""),
        ("mps", r"device='mps' is not supported.*use \"cuda\", \"cuda:0\" or \"cpu\""),
    ],
)
def test_a_device_pager_does_not_run_on_is_refused_before_anything_changes(device, match):
    model = TinyLM()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=match):
        pager.wrap(model, budget="1GiB", device=device)
    assert_untouched(model, snap)
    with pytest.raises(ValueError, match=match):
        pager.Pool(budget="1GiB", device=device)


def test_cpu_0_is_the_cpu():
    """"cpu:0" names the one CPU device: the same as "cpu" (a model on
    either shares the other's engine; before, "cpu:0" was a device of its own
    that a model wrapped with device="cpu" could not share)."""
    first, second = TinyLM(), TinyLM()
    pager.wrap(first, budget="1GiB", device="cpu:0")
    assert pager.of(first).device == torch.device("cpu")
    pager.wrap(second, budget=pager.of(first).engine, device="cpu")
    assert pager.of(second).engine is pager.of(first).engine
    pager.unwrap(second), pager.unwrap(first)


def test_a_cuda_index_the_host_does_not_have(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert budget_mod.resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"device='cuda:2' but this host has 2 CUDA device\(s\).*pass one of them"):
        budget_mod.resolve_device("cuda:2")


# ------------------------------------------------------------ the budget
def test_a_budget_larger_than_the_hosts_memory_is_refused_on_the_cpu_device():
    total = psutil.virtual_memory().total
    model = TinyLM()
    snap = snapshot(model)
    for too_much in (total + 1, budget_mod.format_bytes(2 * total).replace(" ", "")):
        with pytest.raises(ValueError, match=r"larger than this host.s memory \(.*\); give at most that, e.g. '") as e:
            pager.wrap(model, budget=too_much, device="cpu")
        assert_untouched(model, snap)
        assert repr(too_much) in str(e.value)
        suggested = str(e.value).split("e.g. ")[1].rstrip(".").strip("'")
        assert 0 < budget_mod.parse_budget(suggested, torch.device("cpu")) <= total  # the fix it names parses
    assert budget_mod.parse_budget(total, torch.device("cpu")) == total  # all of it: accepted
    assert budget_mod.parse_budget("100%", torch.device("cpu")) == total
    pager.wrap(model, budget="1GiB", device="cpu")
    with pytest.raises(ValueError, match="larger than this host's"):
        pager.of(model).set_budget(total + 1)
    assert pager.of(model).budget_bytes == 1 << 30
    pager.unwrap(model)


def test_a_budget_larger_than_a_cuda_device_is_refused(monkeypatch):
    """The device's own figure (no GPU needed: the device's memory is stood in for)."""
    monkeypatch.setattr(budget_mod, "device_memory", lambda device: (40 << 30, 80 << 30))
    cuda0 = torch.device("cuda", 0)
    assert budget_mod.parse_budget("80GiB", cuda0) == 80 << 30
    with pytest.raises(ValueError, match=r"budget='81GiB' \(81.00 GiB\) is larger than cuda:0's 80.00 GiB"):
        budget_mod.parse_budget("81GiB", cuda0)


@pytest.mark.cuda
def test_a_budget_larger_than_the_gpu_is_refused_before_anything_changes():
    # (the device's total as pager reads it: NVML's, which counts what the driver reserves, above torch's)
    total = budget_mod.device_memory(torch.device("cuda", torch.cuda.current_device()))[1]
    model = TinyLM()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"larger than cuda:\d+'s .*budget=\"90%\" or \"auto\""):
        pager.wrap(model, budget=total + 1, device="cuda")
    assert_untouched(model, snap)
    pager.wrap(model, budget="90%", device="cuda")  # within it: fine
    pager.unwrap(model)


# ------------------------------------------------------------ pickling and deepcopy
def _trained_streaming():
    """A model wrapped under a budget that streams its blocks, a few steps
    trained (so some blocks are paged out, with gradients and state)."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pager.of(model).attach(opt)
    for ids, tgt in batches(2):
        lm_loss(model, ids, tgt).backward()
        opt.step()
        opt.zero_grad()
    return model, ref


def _guarded_inner(model):
    """A module inside a paged-out block, which pager guards against calls
    from outside its block (model/direct_calls.py)."""
    block = next(b for b in pager.of(model).blocks if b.guarded)
    return block.guards[0].module


def _values(model):
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize(
    "dump",
    [
        pytest.param(lambda m: pickle.dumps(m), id="pickle"),
        pytest.param(lambda m: torch.save(m, io.BytesIO()), id="torch.save"),
        pytest.param(lambda m: torch.save(m.layers[1], io.BytesIO()), id="a block"),
        pytest.param(lambda m: pickle.dumps(_guarded_inner(m)), id="a module inside a paged-out block"),
    ],
)
def test_pickling_a_wrapped_model_names_pager_and_the_fix(dump):
    model, _ref = _trained_streaming()
    before = _values(model)
    with pytest.raises(TypeError, match=r"wrapped by pager cannot be pickled.*model\.state_dict\(\).*pager\.unwrap"):
        dump(model)
    consistent(model)
    for name, value in _values(model).items():
        assert_same(value, before[name])
    # The fix it names works while wrapped: the state dict, read back into another model.
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    other = TinyLM()
    other.load_state_dict(torch.load(buffer))
    assert_models_equal(other, model)
    # And once unwrapped, the model pickles as any other.
    pager.unwrap(model)
    assert_models_equal(pickle.loads(pickle.dumps(model)), model)


@pytest.mark.parametrize("activations", ["auto", "keep"])
def test_deepcopy_of_a_wrapped_model_names_pager_and_the_fix(activations):
    """Before, the copy kept the original's hooks: its forward ran through
    the original's pager (fetching the original's blocks, counting its steps)
    and failed once the original was unwrapped."""
    model = TinyLM()
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu", activations=activations)
    ids, tgt = batches(1)[0]
    lm_loss(model, ids, tgt).backward()
    before, on_demand = _values(model), pager.of(model).stats().on_demand
    with pytest.raises(TypeError, match=r"cannot be deep-copied.*load_state_dict\(model\.state_dict\(\)\)"):
        copy.deepcopy(model)
    with pytest.raises(TypeError, match="cannot be deep-copied"):
        copy.deepcopy(model.layers[0])  # a block
    assert pager.of(model).stats().on_demand == on_demand  # refused before any tensor was copied
    consistent(model)
    for name, value in _values(model).items():
        assert_same(value, before[name])
    other = TinyLM()
    other.load_state_dict(model.state_dict())  # the fix it names
    with torch.no_grad():
        assert_same(other(ids), model(ids))
    pager.unwrap(model)
    copied = copy.deepcopy(model)
    assert_models_equal(copied, model)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in copied.modules())


# ------------------------------------------------------------ activations=
def test_a_bad_activations_value_says_what_auto_does():
    model = TinyLM()
    snap = snapshot(model)
    with pytest.raises(ValueError, match="activations='fastest' must be") as e:
        pager.wrap(model, budget="1GiB", device="cpu", activations="fastest")
    assert "decided before the first training forward" in str(e.value)
    assert "tried" not in str(e.value)
    assert_untouched(model, snap)


def test_plan_figures_a_budget_larger_than_this_host():
    """`plan` is for before any GPU work: on a machine without a GPU it
    plans on the CPU device, and a GPU's budget larger than this host's
    memory is planned, not refused (wrap on the CPU device refuses it)."""
    import psutil

    huge = psutil.virtual_memory().total * 2
    p = pager.plan(TinyLM(), huge, device="cpu", host_budget=huge)
    assert p.budget_bytes == huge and p.runs
    with pytest.raises(ValueError, match="larger than this host's memory"):
        pager.wrap(TinyLM(), budget=huge, device="cpu")


def test_a_block_of_a_model_asleep_is_not_pickled_or_copied_either():
    """A model that fits stops running its block hooks after its first
    forwards (asleep): its blocks keep only their state-dict hooks, which
    refuse too ([Note: a wrapped model is not pickled or copied])."""
    model = TinyLM().eval()
    pager.wrap(model, budget="1GiB", device="cpu")
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        model(ids), model(ids)
    assert pager.of(model).asleep
    with pytest.raises(TypeError, match="wrapped by pager cannot be pickled"):
        pickle.dumps(model.layers[0])
    with pytest.raises(TypeError, match="cannot be deep-copied"):
        copy.deepcopy(model.layers[0])


class UntiedLM(torch.nn.Module):
    """A small decoder whose embedding and head (each under 1 MiB) stay in the remainder by default."""

    def __init__(self, vocab=512, d=128, n_layers=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(Layer(d) for _ in range(n_layers))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def test_a_refusal_names_the_small_modules_the_remainder_keeps_and_the_fix_runs():
    # A new user's small model: its embedding and head stay on the device
    # with their gradients and state (each under 1 MiB, they never leave the
    # remainder by themselves), most of what a step needs at least. The
    # refusal names them and says how to page them; that advice then runs
    # in the same budget, within it.
    def build():
        torch.manual_seed(0)
        model = UntiedLM()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, opt = build()
    budget = int(0.4 * 4 * sum(p.numel() * p.element_size() for p in model.parameters()))
    ids = torch.randint(0, 512, (2, 32))
    pager.wrap(model, budget=budget, device="cpu", optimizer=opt)
    with pytest.raises(pager.BudgetError) as refused:
        model(ids).square().mean().backward()
    said = str(refused.value)
    assert "'embed' (256.00 KiB) and 'head' (256.00 KiB) stay" in said and "`blocks=` listing the layers" in said
    assert "'norm'" not in said  # (a norm's few bytes are not worth naming)

    # Where the remainder is a small part of the least, the refusal says nothing of it.
    small = UntiedLM(vocab=64)
    pager.wrap(small, budget=budget // 4, device="cpu", optimizer=torch.optim.AdamW(small.parameters(), lr=1e-3))
    with pytest.raises(pager.BudgetError) as refused:
        small(torch.randint(0, 64, (2, 32))).square().mean().backward()
    assert "for life" not in str(refused.value)

    model, opt = build()
    pager.wrap(model, budget=budget, device="cpu", optimizer=opt, blocks=[*model.layers, model.embed, model.head])
    for _ in range(2):
        model(ids).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert 0 < pager.of(model).stats().peak_device_bytes <= budget
