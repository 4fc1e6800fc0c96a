"""Fetches split over several GPUs' links (`split_fetch=`, [Note: split
fetch] in engine/split_fetch.py): the refusals on any machine; on two GPUs,
values equal to the one-GPU pager's with every copy delayed, the helper's
memory, training, generate and a pool."""

import copy

import pytest
import torch
import torch.nn as nn

import pager
from helpers import streamed_llama, tensor_page_bytes
from models import Thin
from pager.engine import split_fetch

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

    def slow_h2d(dst, src, after=()):
        with torch.cuda.stream(transport.h2d_stream):
            torch.cuda._sleep(cycles // 2)
        return h2d(dst, src, after)

    split._carry, transport.h2d = slow_carry, slow_h2d


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("compute_sleep", [0, 3_000_000])
def test_a_forward_over_two_links_equals_the_bare_model_with_every_copy_delayed(small_shares, compute_sleep):
    model = thin().eval()
    ref = copy.deepcopy(model).to(GPU)
    budget = 2 * tensor_page_bytes(model.layers[0])
    helper_before = torch.cuda.memory_allocated(1)
    pager.wrap(model, budget=budget, device=GPU, split_fetch=["cuda:1"])
    transport = pager.of(model).transport
    assert torch.cuda.memory_allocated(1) - helper_before == transport.split.staging_bytes
    _slow_helpers(transport)
    if compute_sleep:
        record = transport.record_compute
        transport.record_compute = lambda: (torch.cuda._sleep(compute_sleep), record())[1]
    for _ in range(5):
        x = torch.randn(8, 512, device=GPU)
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
    s = pager.of(model).stats()
    assert s.evictions > 0 and s.prefetches > 0 and s.peak_resident_bytes <= budget
    # Every page's share beyond the device's own (about half) crossed from the helper.
    page = tensor_page_bytes(model.layers[0])
    assert s.split_fetch_bytes == s.h2d_bytes // page * transport.helper_bytes(page) > 0.4 * s.h2d_bytes
    assert "over other GPUs' links" in str(s)
    pager.unwrap(model)
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.cuda
@two_gpus
def test_training_over_two_links_equals_the_one_gpu_pager_bit_for_bit(small_shares):
    """Weights, gradients and optimizer state come up split (updates on the
    device): the same kernels on the same GPU give the same bits."""
    torch.manual_seed(0)
    start = thin()
    data = [(torch.randn(16, 512, device=GPU), torch.randn(16, 512, device=GPU)) for _ in range(4)]
    budget = int(2.5 * 4 * tensor_page_bytes(start.layers[0]))
    results = []
    for helpers in (None, ["cuda:1"]):
        model = copy.deepcopy(start)
        pager.wrap(model, budget=budget, device=GPU, optimizer_step="device", activations="keep",
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
        pager.unwrap(model)
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


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
