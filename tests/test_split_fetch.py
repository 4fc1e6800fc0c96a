"""Fetches split over several GPUs' links (`split_fetch=`, [Note: split
fetch] in engine/split_fetch.py): the refusals on any machine; on two GPUs,
values equal to the one-GPU pager's with every copy delayed, the helper's
memory, training, generate and a pool."""

import copy
import gc

import pytest
import torch
import torch.nn as nn

import pager
from helpers import streamed_llama, tensor_page_bytes
from models import Thin
from pager.engine import split_fetch
from test_cuda import sleep_before_marks

GPU = torch.device("cuda", 0)
two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two CUDA GPUs")


def thin():
    """A `Thin` of 1 MiB layers: several pages a forward, each split."""
    return Thin(512, 8)


def test_split_fetch_on_the_cpu_device_is_refused_before_anything_changes():
    model = Thin(64, 3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"split_fetch=\['cuda:1'\].*runs on cpu"):
        pager.wrap(model, budget=10**6, device="cpu", split_fetch=["cuda:1"])
    with pytest.raises(ValueError, match="not wrapped"):
        pager.of(model)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="split_fetch"):
        pager.Pool(budget=10**6, device="cpu", split_fetch="all")


def test_a_plan_with_split_fetch_on_the_cpu_device_is_refused():
    with pytest.raises(ValueError, match="split_fetch"):
        pager.plan(Thin(64, 3), budget=10**6, device="cpu", split_fetch=["cuda:1"])


def test_split_fetch_belongs_to_the_pool_not_to_its_models():
    pool = pager.Pool(budget=10**6, device="cpu")
    with pytest.raises(ValueError, match=r"Give split_fetch to pager.Pool"):
        pager.wrap(Thin(64, 3), pool=pool, split_fetch=["cuda:1"])


@pytest.fixture
def four_gpus_seen(monkeypatch):
    """`resolve_helpers` on any machine: four GPUs, cuda:3 without a peer link to cuda:0."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: 3 not in (a, b))


def test_the_helpers_named_are_checked_and_all_takes_those_with_a_peer_link(four_gpus_seen, pager_log):
    cuda0 = torch.device("cuda", 0)
    assert split_fetch.resolve_helpers("all", cuda0, pin=True) == [torch.device("cuda", 1), torch.device("cuda", 2)]
    assert split_fetch.resolve_helpers([2, "cuda:1"], cuda0, pin=True) == [torch.device("cuda", 2),
                                                                          torch.device("cuda", 1)]
    assert split_fetch.resolve_helpers("cuda:2", cuda0, pin=True) == [torch.device("cuda", 2)]
    with pytest.raises(ValueError, match=r"cuda:3 cannot write to cuda:0 over a peer link"):
        split_fetch.resolve_helpers(["cuda:1", "cuda:3"], cuda0, pin=True)
    with pytest.raises(ValueError, match=r"cuda:4 does not exist; this process sees 4 GPU"):
        split_fetch.resolve_helpers([4], cuda0, pin=True)
    with pytest.raises(ValueError, match=r"names the model's own device \(cuda:0\)"):
        split_fetch.resolve_helpers(["cuda:0"], cuda0, pin=True)
    with pytest.raises(ValueError, match=r"names cuda:1 twice"):
        split_fetch.resolve_helpers(["cuda:1", 1], cuda0, pin=True)
    with pytest.raises(ValueError, match=r"True is not a CUDA device"):
        split_fetch.resolve_helpers([True], cuda0, pin=True)
    with pytest.raises(ValueError, match=r"needs page-locked host pages"):
        split_fetch.resolve_helpers(["cuda:1"], cuda0, pin=False)
    assert not pager_log.records
    # On cuda:3, "all" finds no GPU with a peer link, and says so.
    assert split_fetch.resolve_helpers("all", torch.device("cuda", 3), pin=True) == []
    assert "no other GPU of this process can write to cuda:3" in pager_log.text


def test_each_helper_may_hold_the_devices_budget_or_the_one_given(four_gpus_seen, monkeypatch):
    from pager.base import budget

    monkeypatch.setattr(budget, "device_memory", lambda device: (40 << 30, 80 << 30))
    cuda0, cuda1, cuda2 = (torch.device("cuda", i) for i in range(3))
    given = {"cuda:2": "10GiB", 1: 0}
    helpers = split_fetch.resolve_helpers(given, cuda0, pin=True)
    assert helpers == [cuda2, cuda1]
    assert split_fetch.helper_budgets(given, helpers, 5 << 30) == [10 << 30, 0]
    assert split_fetch.helper_budgets("all", [cuda1, cuda2], 5 << 30) == [5 << 30, 5 << 30]
    assert split_fetch.helper_budgets(["cuda:1"], [cuda1], 5 << 30) == [5 << 30]
    assert split_fetch.helper_budgets({"cuda:1": "25%"}, [cuda1], 5 << 30) == [20 << 30]
    for bad, match in [("lots", "not understood"), (-1, "more than 0"), ("100TiB", "larger than cuda:1"),
                       (True, "not understood")]:
        with pytest.raises(ValueError, match=rf"split_fetch=.*the budget for cuda:1 is not understood.*{match}"):
            split_fetch.helper_budgets({"cuda:1": bad}, [cuda1], 5 << 30)


# ---------------------------------------------------------------- two GPUs
@pytest.fixture
def small_shares(monkeypatch):
    """Pages of the tests' small models split, and a helper's share crosses
    in several chunks (the staging ring wraps within a fetch)."""
    monkeypatch.setattr(split_fetch, "SPLIT_MIN_BYTES", 256 << 10)
    monkeypatch.setattr(split_fetch, "CHUNK_BYTES", 128 << 10)


def _slow_helpers(transport, cycles=1_000_000):
    """Delay each helper's copies up to its staging and across to the device
    (and the device's own share, as test_cuda's `_sleepy` does): a missing
    wait then reads bytes not yet landed, or writes memory still in use."""
    split = transport.split
    carry, h2d = split._carry, transport.h2d

    def slow_carry(helper, *args):
        for stream in helper.streams:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)
        return carry(helper, *args)

    def slow_h2d(dst, src, after=(), seg=None):
        with torch.cuda.stream(transport.h2d_stream):
            torch.cuda._sleep(cycles // 2)
        return h2d(dst, src, after, seg)

    split._carry, transport.h2d = slow_carry, slow_h2d
    kept_pages = transport.kept_pages
    if kept_pages is None:
        return
    copy_up, landed = kept_pages.copy_up, kept_pages.landed

    def slow_copy_up(kept, *args):
        # (the keep stream runs late: its copy lands long after the fetch was asked for)
        with torch.cuda.stream(kept.keeper.stream):
            torch.cuda._sleep(cycles)
        return copy_up(kept, *args)

    def slow_landed(*args):
        # (the join stream runs late: a keeping copy reads the device's page while compute would run)
        with torch.cuda.stream(split.join_stream):
            torch.cuda._sleep(cycles // 2)
        return landed(*args)

    kept_pages.copy_up, kept_pages.landed = slow_copy_up, slow_landed


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("compute_sleep", [0, 3_000_000])
def test_a_forward_over_two_links_equals_the_bare_model_with_every_copy_delayed(small_shares, compute_sleep):
    model = thin().eval()
    ref = copy.deepcopy(model).to(GPU)
    budget = 2 * tensor_page_bytes(model.layers[0])
    gc.collect()  # (earlier tests' helpers' staging is freed with their engines)
    helper_before = torch.cuda.memory_allocated(1)
    pager.wrap(model, budget=budget, device=GPU, split_fetch={"cuda:1": 0})  # (its staging alone: every page splits)
    transport = pager.of(model).transport
    assert transport.kept_pages is None
    assert torch.cuda.memory_allocated(1) - helper_before == transport.split.staging_bytes
    _slow_helpers(transport)
    if compute_sleep:
        sleep_before_marks(transport, compute_sleep)
    for _ in range(5):
        x = torch.randn(8, 512, device=GPU)
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
    s = pager.of(model).stats()
    assert s.evictions > 0 and s.prefetches > 0 and s.peak_resident_bytes <= budget
    # Every page's share beyond the device's own (about half) crossed from the helper.
    page = tensor_page_bytes(model.layers[0])
    assert s.split_fetch_bytes == s.h2d_bytes // page * transport.split.helper_bytes(page) > 0.4 * s.h2d_bytes
    assert "over other GPUs' links" in str(s)
    pager.unwrap(model)
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("optimizer_step", ["device", "host"])
def test_training_over_two_links_equals_the_one_gpu_pager_bit_for_bit(small_shares, optimizer_step):
    """Weights, gradients and optimizer state come up split, updated on the
    device (written back) or on the host: the same kernels give the same
    bits. The helper's copies of weights pages are dropped as the pages
    change, and trained pages are not kept again."""
    torch.manual_seed(0)
    start = thin()
    data = [(torch.randn(16, 512, device=GPU), torch.randn(16, 512, device=GPU)) for _ in range(4)]
    page = tensor_page_bytes(start.layers[0])
    budget = int(2.5 * 4 * page)
    results = []
    for helpers in (None, {"cuda:1": 16 * page}):
        model = copy.deepcopy(start)
        pager.wrap(model, budget=budget, device=GPU, optimizer_step=optimizer_step, activations="keep",
                   split_fetch=helpers)
        if helpers:
            _slow_helpers(pager.of(model).transport)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        for x, y in data:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        s = pager.of(model).stats()
        assert s.evictions > 0 and (s.split_fetch_bytes > 0) == bool(helpers)
        if helpers:
            assert s.host_steps > 0 if optimizer_step == "host" else s.host_steps == 0
            assert s.helper_held_bytes == 0  # (every page changed at each step)
        pager.unwrap(model)
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("compute_sleep", [0, 3_000_000])
def test_pages_a_helper_keeps_come_over_the_peer_link_with_every_copy_delayed(small_shares, compute_sleep):
    """[Note: pages kept on helpers]: the pages the device cannot keep are
    copied to the helper at their second fetch, then come from its memory
    alone; the values stay the bare model's."""
    model = thin().eval()
    ref = copy.deepcopy(model).to(GPU)
    page = tensor_page_bytes(model.layers[0])
    budget = 3 * page
    gc.collect()  # (earlier tests' helpers' staging is freed with their engines)
    helper_before = torch.cuda.memory_allocated(1)
    pager.wrap(model, budget=budget, device=GPU, split_fetch={"cuda:1": 16 * page})
    pg = pager.of(model)
    transport = pg.transport
    _slow_helpers(transport)
    if compute_sleep:
        sleep_before_marks(transport, compute_sleep)
    x = torch.randn(8, 512, device=GPU)
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(model(x), ref(x))
        kept = pg.stats().helper_held_bytes
        assert kept >= 4 * page  # (the 8 layers less those the device keeps)
        assert torch.cuda.memory_allocated(1) - helper_before == transport.split.staging_bytes + kept
        pg.reset()
        for _ in range(3):
            x = torch.randn(8, 512, device=GPU)
            assert torch.equal(model(x), ref(x))
    s = pg.stats()
    # Each streamed page came from the helper's memory: nothing over the links.
    assert s.evictions > 0 and s.split_fetch_bytes == 0 and s.helper_page_bytes == s.h2d_bytes > 0
    assert s.peak_resident_bytes <= budget and "from copies in other GPUs' memory" in str(s)
    pager.unwrap(model)
    assert torch.cuda.memory_allocated(1) - helper_before == transport.split.staging_bytes


@pytest.mark.cuda
@two_gpus
def test_a_helper_keeps_pages_up_to_its_budget_and_the_rest_split(small_shares):
    model = thin().eval()
    ref = copy.deepcopy(model).to(GPU)
    page = tensor_page_bytes(model.layers[0])
    staging = 2 * split_fetch.CHUNK_BYTES
    pager.wrap(model, budget=3 * page, device=GPU, split_fetch={"cuda:1": staging + 2 * page + page // 2})
    pg = pager.of(model)
    _slow_helpers(pg.transport)
    x = torch.randn(8, 512, device=GPU)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), ref(x))
        pg.reset()
        assert torch.equal(model(x), ref(x))
    s = pg.stats()
    assert s.helper_held_bytes == 2 * page
    assert 0 < s.helper_page_bytes <= 2 * page and s.split_fetch_bytes > 0


@pytest.mark.cuda
@two_gpus
def test_weights_changed_after_wrap_drop_the_helpers_copies(small_shares):
    """A page a helper keeps is stale once its weights change (here through
    `load_state_dict`, written back from the device): its copy is dropped
    before a fetch could read it, and the page is kept again later."""
    model = thin().eval()
    page = tensor_page_bytes(model.layers[0])
    pager.wrap(model, budget=3 * page, device=GPU, split_fetch={"cuda:1": 16 * page})
    pg = pager.of(model)
    _slow_helpers(pg.transport)
    x = torch.randn(8, 512, device=GPU)
    with torch.no_grad():
        for _ in range(3):
            model(x)
        assert pg.stats().helper_held_bytes > 0
        new = thin()
        model.load_state_dict(new.state_dict())
        ref = new.to(GPU).eval()
        for _ in range(4):
            assert torch.equal(model(x), ref(x))
    assert pg.stats().helper_held_bytes > 0  # (changed once: kept again)


@pytest.mark.cuda
@two_gpus
def test_generate_over_two_links_equals_the_bare_model(small_shares):
    model, ref, budget = streamed_llama(256, GPU)
    pager.wrap(model, budget=budget, device=GPU, split_fetch="all")
    _slow_helpers(pager.of(model).transport)
    ids = torch.randint(0, 256, (2, 7), device=GPU)
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    assert pager.of(model).stats().split_fetch_bytes > 0


@pytest.mark.cuda
@two_gpus
def test_a_pool_fetches_over_two_links(small_shares):
    pool = pager.Pool(budget=3 * tensor_page_bytes(thin().layers[0]), device=GPU, split_fetch=["cuda:1"])
    models = [thin().eval() for _ in range(2)]
    refs = [copy.deepcopy(m).to(GPU) for m in models]
    for i, m in enumerate(models):
        pager.wrap(m, pool=pool, name=f"m{i}")
    x = torch.randn(4, 512, device=GPU)
    with torch.no_grad():
        for _ in range(3):
            for m, r in zip(models, refs):
                assert torch.equal(m(x), r(x))
    assert all(pager.of(m).stats().split_fetch_bytes > 0 for m in models)


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("split,pin,match", [
    (["cuda:0"], True, "names the model's own device"),
    (["cuda:1", 1], True, "names cuda:1 twice"),
    (["cuda:99"], True, "does not exist"),
    (["cpu"], True, "not a CUDA device"),
    (["cuda:1"], False, "needs page-locked host pages"),
])
def test_split_fetch_refusals_name_the_device_and_the_fix(split, pin, match):
    model = Thin(64, 3)
    with pytest.raises(ValueError, match=match):
        pager.wrap(model, budget=10**6, device=GPU, pin=pin, split_fetch=split)
    with pytest.raises(ValueError, match="not wrapped"):
        pager.of(model)


@pytest.mark.cuda
@two_gpus
def test_the_link_rate_of_plan_and_report_goes_over_the_helpers():
    """The measured ceiling that `report()` compares fetches with, and the
    floor `plan` gives, come through the split fetch path."""
    model = thin()
    budget = 2 * tensor_page_bytes(model.layers[0])
    plan = pager.plan(model, budget, device=GPU, split_fetch=["cuda:1"])
    assert plan.writeback_gbps > 0 and plan.link_gbps > 0
    assert any("split_fetch over 1 other GPU" in n for n in plan.notes)
    pager.wrap(model, budget=budget, device=GPU, split_fetch=["cuda:1"])
    helper = pager.of(model).transport.split.helpers[0]
    before = helper.carried_bytes
    with torch.no_grad():
        model(torch.randn(4, 512, device=GPU))
    assert "measured peak" in pager.of(model).report()
    assert helper.carried_bytes - before >= 3 * (128 << 20)  # (the probe's three copies of 256 MiB, half each)
    assert not plan.helper_kept  # (1 MiB pages do not split, and are not kept)


@pytest.mark.cuda
@two_gpus
def test_a_plan_says_which_streamed_blocks_the_helpers_keep():
    model = Thin(2048, 8)  # (16 MiB layers)
    layer = tensor_page_bytes(model.layers[0])
    alone = pager.plan(model, 3 * layer, device=GPU, split_fetch={"cuda:1": 0})
    assert not alone.helper_kept and alone.forward_helper_bytes == 0 and alone.peer_gbps is None
    plan = pager.plan(model, 3 * layer, device=GPU, split_fetch={"cuda:1": 2 * split_fetch.CHUNK_BYTES + 3 * layer})
    streamed = [n for n, _b in plan.blocks if n not in plan.kept]
    assert plan.helper_kept == streamed[:3] and plan.forward_helper_bytes == 3 * layer
    assert plan.forward_bytes == alone.forward_bytes - 3 * layer and plan.peer_gbps > 0
    assert plan.forward_floor_seconds < alone.forward_floor_seconds
    assert "kept on a helper" in str(plan) and "from the helpers' memory" in str(plan)


@two_gpus
def test_wrap_splits_blocks_for_two_links_only_where_two_take_half_the_room(monkeypatch):
    """[Note: splitting large blocks]: a budget at which one link's pager
    pages the layers' projections keeps whole layers over two links."""
    from models import TinyLM
    from pager.model import discover

    monkeypatch.setattr(discover, "SPLIT_MIN_BYTES", 1024)  # (the test model's projections are a few KiB)
    sizing = discover.adapters_resident(discover.size_up(TinyLM()), 1 << 40)[0]
    budget = sizing.remainder + 5 * max(sizing.own)  # (two take two fifths of the room)
    parts = {}
    for split in (None, ["cuda:1"]):
        model = TinyLM()
        pager.wrap(model, budget=budget, device=GPU, split_fetch=split)
        parts[split is None] = sum(b.part for b in pager.of(model).blocks)
        pager.unwrap(model)
    assert parts[True] > 0 and parts[False] == 0, parts
