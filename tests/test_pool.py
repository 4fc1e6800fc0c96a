"""Serving: several models share one budget (pager.Pool), requests from
several threads wait for room instead of failing, state a forward carries
(a KV cache) counts against the budget, and Hugging Face generate() runs on
a wrapped model. CPU device, bit for bit against the unwrapped models."""

import copy
import random
import threading

import pytest
import torch

import pager
from helpers import assert_same, run_threads, tensor_page_bytes
from models import TinyLM


def stack(n=6, width=32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                 for _ in range(n)])


def pool_of(models, layers_of_room, **kw):
    """A pool whose budget holds `layers_of_room` layers of the first model."""
    pool = pager.Pool(budget=int(layers_of_room * tensor_page_bytes(models[0][0])), device="cpu", **kw)
    for i, m in enumerate(models):
        pager.wrap(m, pool=pool, name=f"m{i}")
    return pool


def watch_peak(pool, models):
    """Record the pool's resident bytes after every layer of every model."""
    peaks = []
    for model in models:
        for layer in model:
            layer.register_forward_hook(lambda *_: peaks.append(pool.engine.resident_bytes))
    return peaks


@pytest.mark.parametrize("n_models", [2, 3])
def test_models_in_one_pool_match_unwrapped_under_random_interleavings_from_threads(n_models):
    models = [stack(seed=s) for s in range(n_models)]
    refs = [copy.deepcopy(m) for m in models]
    pool = pool_of(models, 3)  # less than one model: every request streams
    peaks = watch_peak(pool, models)
    inputs = [torch.randn(4, 32, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    with torch.no_grad():
        expected = [[ref(x) for x in inputs] for ref in refs]

    def serve(thread):
        rng = random.Random(thread)
        for _ in range(30):
            k, i = rng.randrange(n_models), rng.randrange(len(inputs))
            with torch.no_grad():
                assert_same(models[k](inputs[i]), expected[k][i])

    assert run_threads(serve, 4) == []
    s = pool.stats()
    assert set(s.models) == {f"m{i}" for i in range(n_models)}
    assert max(peaks) <= pool.budget_bytes and s.peak_resident_bytes <= pool.budget_bytes
    assert s.timeouts == 0 and s.h2d_bytes == sum(m.h2d_bytes for m in s.models.values())
    assert all(b.pins == b.resident_for_life for o in pool.engine.owners for b in o.all_blocks())


def test_requests_under_inference_mode_from_threads():
    models = [stack(seed=1), TinyLM()]
    refs = [copy.deepcopy(m) for m in models]
    layer = tensor_page_bytes(models[1].layers[0])
    remainder = tensor_page_bytes(models[1]) - sum(tensor_page_bytes(x) for x in models[1].layers)
    pool = pager.Pool(budget=remainder + 3 * layer, device="cpu")
    for m in models:
        pager.wrap(m, pool=pool)
    assert list(pool.models) == ["Sequential", "TinyLM"]
    x, ids = torch.randn(2, 32), torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        want = [refs[0](x), refs[1](ids)]

    def serve(thread):
        with torch.inference_mode():
            for _ in range(10):
                assert_same(models[thread % 2](x if thread % 2 == 0 else ids), want[thread % 2])

    assert run_threads(serve, 4) == []
    assert pool.stats().peak_resident_bytes <= pool.budget_bytes


def test_an_idle_model_lends_its_room_and_alternating_models_share_it():
    a, b = stack(n=8, seed=1), stack(n=8, seed=2)
    pool = pool_of([a, b], 10)  # 10 of the 16 layers
    x = torch.randn(2, 32)
    pa, pb = pager.of(a), pager.of(b)
    with torch.no_grad():
        for _ in range(8):  # alternating: equal shares
            a(x), b(x)
        kept_a = sum(blk.nbytes() for blk in pa.scheduler.kept)
        kept_b = sum(blk.nbytes() for blk in pb.scheduler.kept)
        assert kept_a == kept_b > 0
        for _ in range(20):  # b sits idle: a's share grows to what b lent
            a(x)
        pa.reset()
        a(x)
    assert sum(blk.nbytes() for blk in pa.scheduler.kept) > kept_a
    assert pa.stats().misses < 8 - len(pa.scheduler.kept) + 1  # kept blocks hit
    assert pb.resident_bytes < 8 * tensor_page_bytes(b[0]) - kept_b  # b's blocks left first
    assert pool.stats().peak_resident_bytes <= pool.budget_bytes


def hold_block_in_a_thread(model, layer_index, x):
    """Start a thread whose forward stops inside layer `layer_index` (pinned)
    until the returned event is set. Returns (thread, inside, release, errors)."""
    inside, release, errors = threading.Event(), threading.Event(), []

    def stop(module, args):
        if threading.current_thread() is thread:  # (other threads' forwards pass)
            inside.set()
            release.wait(30)

    handle = model[layer_index].register_forward_pre_hook(stop)

    def run():
        try:
            with torch.no_grad():
                model(x)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    assert inside.wait(30)
    return thread, handle, release, errors


def test_a_request_waits_for_room_held_by_another_then_runs():
    a, b = stack(seed=1), stack(seed=2)
    ref_b = copy.deepcopy(b)
    pool = pool_of([a, b], 1.5)  # one layer at a time
    x = torch.randn(2, 32)
    thread, handle, release, errors = hold_block_in_a_thread(a, 2, x)
    timer = threading.Timer(0.3, release.set)  # a's request lets go of its layer in 0.3 s
    timer.start()
    with torch.no_grad():
        y = b(x)  # needs the room a's layer holds: waits, then runs
    thread.join()
    handle.remove()
    assert errors == [] and pool.stats().waits >= 1 and pool.stats().timeouts == 0
    assert_same(y, ref_b(x))
    pool.reset()  # the pool's counters restart with its models' (they once went to attributes nothing read)
    s = pool.stats()
    assert s.waits == 0 and s.waited_seconds == 0.0 and s.timeouts == 0


def test_a_request_that_waits_too_long_fails_clearly_and_leaves_the_pool_consistent():
    a, b = stack(seed=1), stack(seed=2)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    pool = pool_of([a, b], 1.5, wait_seconds=0.2)
    x = torch.randn(2, 32)
    thread, handle, release, errors = hold_block_in_a_thread(a, 2, x)
    try:
        with pytest.raises(pager.BudgetError, match=r"after waiting 0\.\d s .*\(wait_seconds=0\.2\): m0:2 "):
            with torch.no_grad():
                b(x)
    finally:
        release.set()
        thread.join()
        handle.remove()
    assert errors == []
    s = pool.stats()
    assert s.timeouts == 1 and s.waits == 1
    e = pool.engine
    assert not e.waiters.queue and not e.waiters.waiting
    assert all(blk.pins == blk.resident_for_life for o in e.owners for blk in o.all_blocks())
    with torch.no_grad():  # both run again, bit for bit
        assert_same(b(x), ref_b(x))
        assert_same(a(x), ref_a(x))
    assert e.resident_bytes <= pool.budget_bytes


def test_requests_that_would_wait_for_each_other_fail_rather_than_deadlock():
    """Two requests each hold an outer block and need an inner one; the room
    holds the two outer blocks only: one of them fails at once, the other runs."""
    def nested(seed):
        torch.manual_seed(seed)
        inner = torch.nn.Linear(32, 32)
        return torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(32, 32), inner)), inner

    (a, inner_a), (b, inner_b) = nested(1), nested(2)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    layer = tensor_page_bytes(inner_a)
    pool = pager.Pool(budget=2 * layer, device="cpu", wait_seconds=20)
    pager.wrap(a, pool=pool, blocks=[a[0], inner_a], name="a")
    pager.wrap(b, pool=pool, blocks=[b[0], inner_b], name="b")
    both_inside = threading.Barrier(2)

    def meet(*_):
        both_inside.wait(10)  # each request holds its outer block here

    for outer in (a[0], b[0]):
        outer[0].register_forward_hook(meet)
    x, results = torch.randn(2, 32), {}

    def serve(i):
        with torch.no_grad():
            results[i] = (a, b)[i](x)

    errors = run_threads(serve, 2)
    assert len(errors) == 1 and isinstance(errors[0], pager.BudgetError)
    assert "all wait for room themselves" in str(errors[0])
    (ok,) = results
    assert_same(results[ok], (ref_a, ref_b)[ok](x))
    assert all(blk.pins == 0 for o in pool.engine.owners for blk in o.all_blocks())


def test_one_model_from_several_threads_waits_instead_of_failing():
    model = stack()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=2 * tensor_page_bytes(model[0]), device="cpu")
    x = torch.randn(3, 32)
    want = ref(x).detach()

    def serve(_):
        for _ in range(25):
            with torch.no_grad():
                assert_same(model(x), want)

    assert run_threads(serve, 4) == []


def test_pool_arguments_are_checked_before_anything_changes():
    m = stack()
    before = [t.clone() for t in m.parameters()]
    pool = pager.Pool(budget="1MiB", device="cpu")
    with pytest.raises(ValueError, match="not both"):
        pager.wrap(m, budget="1MiB", pool=pool)
    with pytest.raises(ValueError, match="takes a pager.Pool"):
        pager.wrap(m, pool="1MiB")
    with pytest.raises(ValueError, match="needs budget="):
        pager.wrap(m)
    with pytest.raises(ValueError, match="wait_seconds=0"):
        pager.Pool(budget="1MiB", device="cpu", wait_seconds=0)
    with pytest.raises(ValueError, match="name=''"):
        pager.wrap(m, pool=pool, name="")
    pager.wrap(m, pool=pool, name="chat")
    with pytest.raises(ValueError, match="name='chat' is taken"):
        pager.wrap(stack(seed=3), pool=pool, name="chat")
    pager.unwrap(m)
    assert all(torch.equal(t, u) for t, u in zip(m.parameters(), before))
    assert pool.models == {}


def test_pool_budget_stats_and_leaving():
    a, b = stack(seed=1), stack(seed=2)
    ref_b = copy.deepcopy(b)
    layer = tensor_page_bytes(a[0])
    pool = pool_of([a, b], 12)
    x = torch.randn(2, 32)
    with torch.no_grad():
        a(x), b(x)
    assert pool.stats().resident_bytes == 12 * layer  # both fit: nothing left
    with pytest.raises(ValueError, match="below the"):
        pool.set_budget(layer // 2)
    pool.set_budget(3 * layer)
    assert pool.engine.resident_bytes <= 3 * layer and pool.budget_bytes == 3 * layer
    assert pager.of(a).stats().budget_bytes == 3 * layer
    pool.reset()
    with torch.no_grad():
        b(x)
    s = pool.stats()
    assert s.peak_resident_bytes <= 3 * layer and s.models["m1"].misses > 0 and s.models["m0"].misses == 0
    assert "pool: 2 model(s)" in pool.report() and "m1:" in pool.report()
    pager.unwrap(a)
    assert list(pool.models) == ["m1"] and all(blk.owner is pager.of(b) for blk in pool.engine.resident)
    with torch.no_grad():
        assert_same(b(x), ref_b(x))
    assert "m1" in repr(pool)


# ------------------------------------------------------------ carried state
class CachedStack(torch.nn.Module):
    """A stack whose forward appends its layers' outputs to a cache object
    passed in, as a decoder's KV cache grows by one step per call."""

    def __init__(self, n=6, width=32):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))

    def forward(self, x, cache):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            cache.layers[i] = x if cache.layers[i] is None else torch.cat([cache.layers[i], x])
        return x


class Cache:
    def __init__(self, n):
        self.layers = [None] * n


def test_state_carried_between_forwards_counts_against_the_budget():
    torch.manual_seed(0)
    model = CachedStack()
    layer = tensor_page_bytes(model.layers[0])
    pager.wrap(model, budget=5 * layer, device="cpu")
    p, cache = pager.of(model), Cache(6)
    x = torch.randn(2, 32)
    with torch.no_grad():
        for step in range(3):
            model(x, cache)
            want = sum(t.untyped_storage().nbytes() for t in cache.layers)
            assert p.stats().carried_bytes == want == 6 * 2 * (step + 1) * 32 * 4
            assert p.room_bytes() == 5 * layer - want
            assert p.resident_bytes <= 5 * layer - want  # idle blocks left as the cache grew
    assert p.stats().peak_carried_bytes == want
    with torch.no_grad():
        model(x, Cache(6))  # a new, smaller cache: the room comes back
    assert p.stats().carried_bytes == 6 * 2 * 32 * 4


def test_a_cache_that_crowds_the_blocks_warns_and_still_runs(pager_log):
    torch.manual_seed(0)
    model = CachedStack(width=16)
    ref = copy.deepcopy(model)
    layer = tensor_page_bytes(model.layers[0])
    pager.wrap(model, budget=2 * layer, device="cpu")
    cache, ref_cache = Cache(6), Cache(6)
    x = torch.randn(8, 16)
    with torch.no_grad():
        for _ in range(3):
            assert_same(model(x, cache), ref(x, ref_cache))
    assert "a KV cache" in pager_log.text and "leaves less of the" in pager_log.text


# ---------------------------------------------------------------- generate()
def tiny_llama(seed):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def layers_budget(model, n):
    layers = model.model.layers
    rest = tensor_page_bytes(model) - sum(tensor_page_bytes(x) for x in layers)
    return rest + n * tensor_page_bytes(layers[0])


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_greedy_matches_unwrapped(use_cache):
    model = tiny_llama(0)
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=layers_budget(model, 2), device="cpu")
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=8, do_sample=False, use_cache=use_cache, pad_token_id=0)
    with torch.no_grad():
        assert_same(model.generate(ids, **kw), ref.generate(ids, **kw))
    p = pager.of(model)
    assert p.stats().misses > 0  # it streamed
    if use_cache:
        assert p.stats().peak_carried_bytes > 0


def test_generate_sampling_in_a_pool_beside_another_model_matches_unwrapped():
    model, other = tiny_llama(0), tiny_llama(1)
    ref, ref_other = copy.deepcopy(model), copy.deepcopy(other)
    pool = pager.Pool(budget=layers_budget(model, 5), device="cpu")
    pager.wrap(model, pool=pool, name="chat")
    pager.wrap(other, pool=pool, name="other")
    ids = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=0)
    outs = []
    for m in (model, other, ref, ref_other):
        torch.manual_seed(5)
        with torch.inference_mode():
            outs.append(m.generate(ids, **kw))
    assert_same(outs[0], outs[2])
    assert_same(outs[1], outs[3])
    s = pool.stats()
    assert s.peak_resident_bytes <= pool.budget_bytes
    assert s.models["chat"].misses > 0 and s.models["other"].misses > 0


def test_the_next_models_streamed_blocks_are_prefetched_during_this_ones_kept_tail():
    """Alternating models: kept blocks sit at the end of each plan, and a
    request's prefetch goes on into the next model's plan, so every use of
    both models finds its block already fetched."""
    a, b = stack(n=8, seed=1), stack(n=8, seed=2)
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    pool = pool_of([a, b], 10)
    x = torch.randn(2, 32)
    with torch.no_grad():
        for _ in range(6):
            a(x), b(x)
        pool.reset()
        for _ in range(2):
            assert_same(a(x), ref_a(x))
            assert_same(b(x), ref_b(x))
    s = pool.stats()
    for name, m in (("m0", a), ("m1", b)):
        kept = pager.of(m).scheduler.kept
        assert {blk.name for blk in kept} == {str(i) for i in range(8 - len(kept), 8)}  # the last ones
        assert 0 < len(kept) < 8
        assert s.models[name].misses == 0 and s.models[name].prefetches > 0
    assert s.peak_resident_bytes <= pool.budget_bytes


def test_a_model_that_mostly_follows_itself_spreads_its_kept_set():
    """A pipeline's transformer runs step after step between one call of each
    other model: it is its own next request, so its kept set is spread
    through its plan (a kept tail would leave the link idle through it) and
    every step's uses find their blocks fetched; models served in turn keep
    the tail."""
    enc, den = stack(n=8, seed=1), stack(n=8, seed=2)
    ref_enc, ref_den = copy.deepcopy(enc), copy.deepcopy(den)
    pool = pool_of([enc, den], 7)
    x = torch.randn(2, 32)
    with torch.no_grad():
        for call in range(3):
            if call == 2:
                pool.reset()
            assert_same(enc(x), ref_enc(x))
            for _ in range(8):
                assert_same(den(x), ref_den(x))
    kept = sorted(int(blk.name) for blk in pager.of(den).scheduler.kept)
    assert 1 < len(kept) < 7 and kept != list(range(8 - len(kept), 8))
    assert max(b - a for a, b in zip(kept, kept[1:])) > 1  # (no two kept side by side at the tail only)
    assert pool.stats().models["m1"].misses <= 1  # (the first step after the encoder's call)
    assert pool.engine.room.runs_in_turn(pager.of(enc))
    assert not pool.engine.room.runs_in_turn(pager.of(den))


def test_kept_sets_early_late_or_spread_through_the_plan():
    from pager.base.common import WEIGHTS
    from pager.engine.schedule import Scheduler

    sched = Scheduler()
    blocks = [f"b{i}" for i in range(8)]
    sched.plan = [(blk, WEIGHTS) for blk in blocks]
    assert sched.reads_only()
    sched.choose_kept(60, lambda blk: 10, 0)  # two blocks of streaming room
    assert sched.kept == set(blocks[:4])
    sched.choose_kept(60, lambda blk: 10, 0, order="late")
    assert sched.kept == set(blocks[4:])
    sched.choose_kept(60, lambda blk: 10, 0, order="spread")  # no run of kept blocks longer than one
    assert sched.kept == {"b0", "b2", "b4", "b6"}
    sched.choose_kept(50, lambda blk: 10, 0, order="spread")
    assert sched.kept == {"b0", "b4", "b2"}


def test_the_example_server_answers_both_models_bit_for_bit():
    import pathlib
    import subprocess
    import sys

    example = pathlib.Path(__file__).parent.parent / "examples" / "serve.py"
    run = subprocess.run([sys.executable, str(example), "--demo", "4", "--layers", "4"], capture_output=True,
                         text=True, timeout=300, env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("(equal to unwrapped: True)") == 4 and "pool: 2 model(s)" in run.stdout


def test_concurrent_forwards_of_one_model_record_one_step_at_a_time(pager_log):
    """While one request's forward is in flight, other threads' forwards of the
    same model run (and count as requests) without writing into its step's
    recording: the plan stays one forward's order, and a server whose model is
    never idle does not grow its recording without bound."""
    model = stack()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=3 * tensor_page_bytes(model[0]), device="cpu")
    p = pager.of(model)
    x = torch.randn(2, 32)
    with torch.no_grad():
        model(x), model(x)
    order = [blk.name for blk, _k in p.scheduler.plan]
    thread, handle, release, errors = hold_block_in_a_thread(model, 2, x)  # a request stops inside layer 2
    try:
        with torch.no_grad():
            for _ in range(5):  # others run meanwhile
                assert_same(model(x), ref(x))
                assert len(p.scheduler.recording) <= len(order)
    finally:
        release.set()
        thread.join()
        handle.remove()
    assert errors == []
    with torch.no_grad():
        model(x)
        model(x)
    assert [blk.name for blk, _k in p.scheduler.plan] == order
    assert "order of blocks changed" not in pager_log.text
