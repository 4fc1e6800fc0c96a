"""With a second Python thread alive, every pager is in the shared mode
([Note: tensors and threads] in base/served.py): a block in use stays guarded
and only the threads that pinned it pass unserved. The transparency, kept-view,
training and activation suites run again here in that mode, and another thread reads every
tensor while the model trains under a tight budget."""

import copy
import threading

import pytest
import torch

import pager
from helpers import assert_models_equal, assert_same, reading_in_a_thread
from models import TinyLM
from test_kept_views import *  # noqa: F401,F403 - run again in the shared mode
from test_training import batches, lm_loss, regime_budget
from test_training import test_training_matches_unwrapped_bit_for_bit  # noqa: F401
from test_training import test_supernet_random_paths_train_like_unwrapped  # noqa: F401
from test_training import test_deferred_updates_equal_immediate_ones_with_a_schedule_clip_and_eval  # noqa: F401
from test_transparency import *  # noqa: F401,F403
from test_activations import test_training_with_activations_paged_matches_unwrapped  # noqa: F401
from test_activations import test_views_outputs_and_dropout_masks  # noqa: F401

# Not in the shared mode: every object is searched only with one Python thread.
del test_training_steps_search_python_objects_only_when_something_new_is_kept  # noqa: F821


@pytest.fixture(autouse=True)
def _second_thread():
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait, daemon=True)
    idle.start()
    yield
    stop.set()
    idle.join()


def test_the_shared_mode_is_on_and_the_forward_thread_is_not_served():
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    opts = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for ids, tgt in batches(3):
        for m, o in zip((model, ref), opts):
            lm_loss(m, ids, tgt).backward()
            o.step()
            o.zero_grad()
    p = pager.of(model)
    assert p.shared_mode
    assert p.stats().on_demand == 0  # the blocks' own uses passed the guard unserved
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_another_thread_reads_every_tensor_while_the_model_trains():
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu")
    opts = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    def check(t):
        if not torch.isfinite(t.detach().sum()):
            raise AssertionError("a read saw a non-finite sum")

    with reading_in_a_thread(list(model.parameters()) + list(model.buffers()), check) as log:
        for ids, tgt in batches(6):
            for m, o in zip((model, ref), opts):
                lm_loss(m, ids, tgt).backward()
                o.step()
                o.zero_grad()
    errors, reads = log["errors"], [log["reads"]]
    assert not errors, errors
    assert reads[0] > 0
    pager.unwrap(model)
    assert_models_equal(model, ref)  # the reads changed nothing


def test_guarded_parameters_keep_torch_optims_foreach_path():
    """torch.optim picks its foreach implementation by the exact class of each
    parameter; in the shared mode they are guarded during the step, and must
    not fall back to the per-tensor loop (slower, and not bitwise the same)."""
    import torch.optim.optimizer as optimizer

    from pager.base.guards import GuardedParameter, GuardedTensor

    assert GuardedParameter in optimizer._foreach_supported_types
    assert GuardedTensor in optimizer._foreach_supported_types


def test_another_threads_read_applies_a_pending_update_without_touching_the_optimizer():
    """A read from another thread of a block whose optimizer update is still
    deferred applies it ([Note: a deferred update touches nothing the user
    holds]): the read sees the updated weight, the training thread's optimizer
    groups and gradients are untouched, and training goes on bit for bit."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu", optimizer_step="device")
    opts = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(4)
    for ids, tgt in data[:2]:
        for m, o in zip((model, ref), opts):
            lm_loss(m, ids, tgt).backward()
            o.step()
    pending = [b for b in pager.of(model).blocks if b.deferred_steps]
    assert pending, "the budget should leave some updates deferred"
    groups = [list(g["params"]) for g in opts[0].param_groups]
    seen = []
    reader = threading.Thread(target=lambda: seen.extend(float(p.sum()) for p in model.parameters()))
    reader.start()
    reader.join(timeout=60)
    assert seen == [float(q.sum()) for q in ref.parameters()]
    assert [list(g["params"]) for g in opts[0].param_groups] == groups
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.grad.clone(), q.grad)  # the step-time gradients are still the user's
    for ids, tgt in data[2:]:
        for m, o in zip((model, ref), opts):
            o.zero_grad()
            lm_loss(m, ids, tgt).backward()
            o.step()
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_reads_from_another_thread_while_the_pager_sleeps_and_wakes():
    """The sleeping pager keeps its guards in the shared mode: another
    thread's reads run unserved but counted, and waking (here by a lower
    budget, which evicts) waits for them before anything leaves."""
    model = TinyLM()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget="1GiB", device="cpu")
    p = pager.of(model)
    ids = batches(1)[0][0]
    expected = {id(p): float(q.sum()) for p, q in zip(model.parameters(), ref.parameters())}

    def check(t):
        if float(t.sum()) != expected[id(t)]:
            raise AssertionError("a read saw a wrong value")

    streams = regime_budget(model, "streams", state_factor=-1)  # weights only: ~2.5 layers beside the remainder
    slept = 0
    with reading_in_a_thread(list(model.parameters()), check) as log:
        with torch.no_grad():
            # A forward sleeps only if no read holds a block as it starts: at
            # least 6 rounds, and until one has slept (at most 100).
            for rounds in range(100):
                for _ in range(3):
                    model(ids)
                slept += p.asleep
                p.set_budget(streams)  # evicts, from this thread
                model(ids)
                p.set_budget("1GiB")
                if rounds >= 5 and slept:
                    break
    errors, reads = log["errors"], [log["reads"]]
    assert not errors, errors
    s = p.stats()
    # Evicted, and fetched again (by the forward, or by a read that came first).
    assert slept and reads[0] > 0 and s.evictions > 0 and s.h2d_bytes > p.total_bytes
    assert_same(model(ids), ref(ids))


OUTSIDE: list = []  # where a forward below keeps views: not an attribute, not an output


class KeepsOutside(torch.nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    keep = True

    def forward(self, x):
        if self.keep:
            OUTSIDE.append(self.lin.weight[:2])
        return torch.tanh(self.lin(x))


def test_a_view_kept_where_pager_cannot_search_keeps_its_block():
    """With other threads about, every Python object cannot be searched; a
    view a no-grad forward kept somewhere else (here a module-level list)
    keeps its block on the device while it lives, and reads the right values."""
    from test_transparency import page_out_everything

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[KeepsOutside() for _ in range(6)])
    ref = copy.deepcopy(model)
    one = sum(t.numel() * t.element_size() for t in model[0].state_dict().values())
    pager.wrap(model, budget=6 * one + 4096, device="cpu")  # room for all: the kept views hold every block
    x = torch.randn(4, 32)
    OUTSIDE.clear()
    with torch.no_grad():
        model(x)
        kept = list(OUTSIDE)
        OUTSIDE.clear()
        ref(x)
        ref_kept = list(OUTSIDE)
    OUTSIDE.clear()
    page_out_everything(model, check=False)
    blocks = pager.of(model).blocks
    assert pager.of(model).shared_mode
    assert all(b.weights.resident for b in blocks)  # each kept view holds its block
    for k, r in zip(kept, ref_kept):
        assert_same(k, r)
    del k, r
    kept.clear()
    page_out_everything(model, check=False)
    assert not any(b.weights.resident for b in blocks)  # the views are gone: the blocks may leave


def test_a_view_kept_by_a_training_forward_where_pager_cannot_search_keeps_its_block():
    """Autograd's saved views are counted ([Note: autograd's saved views,
    counted]), so blocks still leave between forward and backward; a view a
    training forward keeps where pager cannot search keeps its block on the
    device while it lives, and reads the right values."""
    from test_transparency import page_out_everything

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[KeepsOutside() for _ in range(6)])
    for layer in model:
        layer.keep = False
    ref = copy.deepcopy(model)
    one = sum(t.numel() * t.element_size() for t in model[0].state_dict().values())
    # A kept block and a step's block fit (activations beside the budget).
    pager.wrap(model, budget=4 * one + 4096, device="cpu", activations="keep")
    blocks = pager.of(model).blocks
    x = torch.randn(4, 32)
    first_left = []
    model[5].register_forward_pre_hook(lambda *_: first_left.append(not blocks[0].weights.resident))
    for m in (model, ref):  # nothing kept: the blocks leave as the forward goes on
        m(x).pow(2).sum().backward()
    assert pager.of(model).shared_mode and first_left == [True]
    kept = {}
    for m in (model, ref):
        m[1].keep = True
        OUTSIDE.clear()
        out = m(x)
        kept[m] = list(OUTSIDE)
        OUTSIDE.clear()
        if m is model:
            page_out_everything(model, check=False)
            assert blocks[1].weights.resident and not blocks[0].weights.resident and first_left[-1]
        out.pow(2).sum().backward()
    assert_same(kept[model][0], kept[ref][0])
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.grad, q.grad)
    del kept, out
    page_out_everything(model, check=False)
    assert not blocks[1].weights.resident  # the view is gone: the block may leave
