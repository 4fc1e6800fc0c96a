"""Embedding tables paged by rows ([Note: row tables] in rows/table.py), on the CPU device: bit for bit
with the unwrapped model and the same optimizer."""

import copy
import io

import pytest
import torch
import torch.nn as nn

import pager
from pager.rows.tensors import RowGrad, RowTableParameter

ROWS, BAG_ROWS, DIM = 1000, 300, 16


class Recommender(nn.Module):
    def __init__(self, sparse=True, padding_idx=3, max_norm=None, mode="sum", scale_grad_by_freq=False):
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM, sparse=sparse, padding_idx=padding_idx, max_norm=max_norm,
                                scale_grad_by_freq=scale_grad_by_freq)
        self.bag = nn.EmbeddingBag(BAG_ROWS, DIM, mode=mode, sparse=sparse)
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(3)])

    def forward(self, ids, bag_ids, offsets, weights=None):
        x = self.emb(ids).sum(1) + self.bag(bag_ids, offsets, per_sample_weights=weights)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).sum()


def batches(steps, seed=0, ids_range=ROWS, bag_range=BAG_ROWS):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, ids_range, (4, 6), generator=g)
        ids[0, 0] = 3  # the padding row
        ids[1, :] = ids[1, 0]  # a row repeated in a batch
        bag_ids = torch.randint(0, bag_range, (14,), generator=g)
        bag_ids[5:9] = bag_ids[4]
        out.append((ids, bag_ids, torch.tensor([0, 3, 7, 10])))
    return out


def wrap(model, **kw):
    kw.setdefault("rows", [model.emb, "bag"])
    kw.setdefault("row_cache", 600 * DIM * 4)
    # Blocks need about 3 KiB, 12 KiB with their gradients and Adam's state: the layers stream
    # through a budget of a few of them beside the cache and the activations (about 1.4 KiB).
    return pager.wrap(model, budget=kw["row_cache"] + 16000, device="cpu", **kw)


def sparse_optimizers(model, make):
    tables = list(model.emb.parameters()) + list(model.bag.parameters())
    return [make(tables), torch.optim.SGD(model.layers.parameters(), lr=0.05)]


def train(model, opts, data, accumulate=1, clip=None):
    for batch in data:
        for _ in range(accumulate):
            model(*batch).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()


def trained_pair(make, data, **wrap_kw):
    """An unwrapped model and its wrapped copy, each trained on `data` with optimizers from `make`."""
    ref = Recommender()
    model = wrap(copy.deepcopy(ref), **wrap_kw)
    ro, po = sparse_optimizers(ref, make), sparse_optimizers(model, make)
    train(ref, ro, data)
    train(model, po, data)
    return ref, model, ro, po


def assert_same(ref, model):
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


SPARSE = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01),
    "sparse_adam": lambda ps: torch.optim.SparseAdam(ps, lr=0.01),
}


@pytest.mark.parametrize("opt", sorted(SPARSE))
def test_sparse_optimizers_equal_unwrapped(opt):
    ref, model, ro, po = trained_pair(SPARSE[opt], batches(5))
    assert_same(ref, model)
    s = pager.of(model).stats()
    assert s.row_hits > 0 and s.row_misses > 0  # the cache served some rows, the host the others
    ref_state, state = ro[0].state_dict()["state"], po[0].state_dict()["state"]
    for k in ref_state:
        for key, value in ref_state[k].items():
            assert (torch.equal(value, state[k][key]) if isinstance(value, torch.Tensor)
                    else value == state[k][key]), (k, key)


@pytest.mark.parametrize("cache", [0, 40 * DIM * 4, 10**6])
def test_any_cache_size_gives_the_same_values(cache):
    """Evictions (a cache smaller than a batch), no cache, and a cache holding everything."""
    # (rows come back: hits once cached)
    ref, model, _ro, _po = trained_pair(SPARSE["sparse_adam"], batches(6, ids_range=120, bag_range=60), row_cache=cache)
    assert_same(ref, model)
    if cache == 10**6:
        assert pager.of(model).stats().row_hits > 0


class TwoLookups(nn.Module):
    """One table looked up once or twice a forward (the second lookup can push the first one's rows out)."""

    def __init__(self, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM, sparse=True, padding_idx=padding_idx)
        self.lin = nn.Linear(DIM, 1)

    def forward(self, ids, more=None):
        x = self.emb(ids).sum(1)
        if more is not None:
            x = x + self.emb(more).sum(1)
        return self.lin(x).pow(2).sum()


def test_the_step_counts_misses_only_when_the_cache_may_have_lost_rows(monkeypatch):
    """After one lookup the step takes that lookup's batch and slots (no gather); after lookups whose rows the
    cache took in and kept, the step knows each gradient row is cached and does not count misses (on CUDA a
    host sync); after a lookup that pushed earlier rows out, it counts. Either way the values are the
    unwrapped model's."""
    from pager.rows.table import RowTable

    counted = []  # per step: the miss count the step's gather was given (None: it counts)
    real_gather, real_step = RowTable.gather, RowTable.step
    stepping = []

    def gather(self, rows, kinds, insert=True, n_miss=None, read=None):
        if stepping:
            counted.append(n_miss)
        return real_gather(self, rows, kinds, insert, n_miss, read)

    def step(self, *args):
        stepping.append(True)
        try:
            return real_step(self, *args)
        finally:
            stepping.pop()

    monkeypatch.setattr(RowTable, "gather", gather)
    monkeypatch.setattr(RowTable, "step", step)
    g = torch.Generator().manual_seed(5)
    ref = TwoLookups()
    cache = 26 * (DIM * 4 * 3 + 17) + 4 * (ROWS + 1)  # about 25 rows of the weight and SparseAdam's two columns
    model = pager.wrap(copy.deepcopy(ref), budget=10**6, device="cpu", rows=["emb"], row_cache=cache)
    opts = [torch.optim.SparseAdam(m.emb.parameters(), lr=0.01) for m in (ref, model)]
    opts += [torch.optim.SGD(m.lin.parameters(), lr=0.01) for m in (ref, model)]
    # (a second lookup: none; of rows the first took in, which it keeps; of 18 new rows, which push some out)
    for second, expected in ((None, []), ("held", [0] * 3), ("new", [None] * 3), (None, [])):
        counted.clear()
        for _ in range(3):
            ids = torch.randint(0, ROWS, (3, 6), generator=g)  # 18 rows or fewer: they fit the cache
            more = {None: None, "held": ids[:, 1:4], "new": torch.randint(0, ROWS, (3, 6), generator=g)}[second]
            for m in (ref, model):
                m(ids, more).backward()
            for o in opts:
                o.step()
                o.zero_grad()
        assert counted == expected, (second, counted)
        assert_same(ref, model)
    assert 18 <= pager.of(model).row_tables[0].cache.capacity < 36  # one lookup fits, two do not


@pytest.mark.parametrize("pad", [None, 0])
def test_a_step_after_one_lookup_takes_that_lookups_rows(monkeypatch, pad):
    """One lookup's sparse gradient has a term for each row it looked up, unless the padding row is among them
    (torch's backward leaves its lookups out): then the step takes the lookup's rows as they are, with no
    unique (on CUDA a host sync). A padding row, or a second backward, makes it find the gradient's rows
    again. Either way the values are the unwrapped model's."""
    uniques = []
    real_unique = torch.unique

    def unique(*args, **kwargs):
        uniques.append(args[0].numel())
        return real_unique(*args, **kwargs)

    g = torch.Generator().manual_seed(7)
    ref = TwoLookups(padding_idx=pad)
    model = pager.wrap(copy.deepcopy(ref), budget=10**6, device="cpu", rows=["emb"], row_cache=10**5)
    opts = [torch.optim.SparseAdam(m.emb.parameters(), lr=0.01) for m in (ref, model)]
    opts += [torch.optim.SGD(m.lin.parameters(), lr=0.01) for m in (ref, model)]
    for twice in (False, True, False):
        found = []
        for _ in range(3):
            ids = torch.randint(0, ROWS, (3, 6), generator=g)
            ids[0, 0] = 0
            more = torch.randint(0, ROWS, (3, 6), generator=g) if twice else None
            for m in (ref, model):
                m(ids, more).backward()
            monkeypatch.setattr(torch, "unique", unique)
            uniques.clear()
            for o in opts:
                o.step()
            monkeypatch.setattr(torch, "unique", real_unique)
            found.append(len(uniques))
            for o in opts:
                o.zero_grad()
        assert found == ([1] * 3 if twice or pad is not None else [0] * 3), (twice, found)
        assert_same(ref, model)


@pytest.mark.parametrize("name", ["sgd_momentum", "adam", "adamw", "rmsprop"])
def test_dense_optimizers_equal_unwrapped_when_every_row_is_touched(name):
    """Adam-like optimizers update touched rows only (lazy); where every step touches every row, that is
    torch's dense update, bit for bit."""
    make = {"sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
            "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
            "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01)}[name]
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(24, DIM), nn.Linear(DIM, 1))
    model = pager.wrap(copy.deepcopy(ref), budget=10**6, device="cpu", rows=["0"], row_cache=8 * DIM * 4)
    ro, po = make(ref.parameters()), make(model.parameters())
    for step in range(4):
        ids = torch.randperm(24).view(4, 6)
        for m, o in ((ref, ro), (model, po)):
            m(ids).sum().backward()
            o.step()
            o.zero_grad()
    assert_same(ref, model)


def test_adam_is_lazy_on_untouched_rows():
    torch.manual_seed(0)
    model = pager.wrap(nn.Sequential(nn.Embedding(50, DIM), nn.Linear(DIM, 1)), budget=10**6, device="cpu",
                       rows=["0"])
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    opt.zero_grad()
    before = model[0].weight.detach().clone()
    model(torch.tensor([4, 5])).sum().backward()
    opt.step()
    after = model[0].weight.detach()
    assert torch.equal(before[1:4], after[1:4])  # momentum does not move rows this step did not touch
    assert not torch.equal(before[4:6], after[4:6])
    state = opt.state[model[0].weight]
    assert int(state["step"]) == 2 and state["exp_avg"][7].abs().sum() == 0 and state["exp_avg"][4].abs().sum() > 0


def test_options_padding_max_norm_freq_and_bag_modes():
    # (sparse=False: dense gradients, which Adagrad's update leaves untouched rows unchanged by; torch has no
    # sparse gradient with scale_grad_by_freq.)
    for kw in ({"max_norm": 1.0}, {"scale_grad_by_freq": True, "sparse": False}, {"mode": "mean"},
               {"mode": "max", "sparse": False}, {"padding_idx": None}):
        ref = Recommender(**kw)
        with torch.no_grad():
            ref.emb.weight.mul_(3)  # rows over max_norm: renormalised by the lookup
        model = wrap(copy.deepcopy(ref))
        ro, po = sparse_optimizers(ref, SPARSE["adagrad"]), sparse_optimizers(model, SPARSE["adagrad"])
        data = batches(3)
        train(ref, ro, data)
        train(model, po, data)
        assert_same(ref, model)


def test_per_sample_weights_2d_bags_and_include_last_offset():
    torch.manual_seed(1)
    ref = nn.ModuleDict({"a": nn.EmbeddingBag(200, DIM, mode="sum", sparse=True, include_last_offset=True),
                         "b": nn.EmbeddingBag(200, DIM, mode="mean", sparse=True, padding_idx=0)})
    model = pager.wrap(copy.deepcopy(ref), budget=10**6, device="cpu", rows=["a", "b"], row_cache=50 * DIM * 4)
    ro, po = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        ids = torch.randint(0, 200, (12,), dtype=torch.int32)  # int32 lookups and offsets
        ids[2] = ids[3]
        w = torch.rand(12)
        bags = torch.randint(0, 200, (3, 4))
        bags[0, 0] = 0
        for m, o in ((ref, ro), (model, po)):
            offsets = torch.tensor([0, 4, 9, 12], dtype=torch.int32)
            out = m["a"](ids, offsets, per_sample_weights=w).sum() + m["b"](bags).pow(2).sum()
            out.backward()
            o.step()
            o.zero_grad()
    assert_same(ref, model)


def test_accumulation_clipping_and_zeroing_without_set_to_none():
    ref = Recommender()
    model = wrap(copy.deepcopy(ref))
    make = SPARSE["sgd"]
    ro, po = sparse_optimizers(ref, make), sparse_optimizers(model, make)
    data = batches(3)
    train(ref, ro, data, accumulate=2)
    train(model, po, data, accumulate=2)
    assert pager.of(model).stats().row_flushes == 0  # (the loop itself reads no host table)
    assert_same(ref, model)
    # zero_grad(set_to_none=False) zeroes the pieces: the next step applies only what follows.
    for m, opts in ((ref, ro), (model, po)):
        m(*data[0]).backward()
        for o in opts:
            o.zero_grad(set_to_none=False)
        m(*data[1]).backward()
        for o in opts:
            o.step()
    assert_same(ref, model)
    # clip_grad_norm_ works on a row table's gradient (torch cannot take the norm of a sparse one):
    for o in po:
        o.zero_grad()
    model(*data[2]).backward()
    grad = model.emb.weight.grad
    assert isinstance(grad, RowGrad) and grad.is_sparse and grad.device.type == "cpu"
    expected = model.emb.weight.grad.coalesce()  # (made real: the stand-in's values on the host)
    assert not isinstance(model.emb.weight.grad, RowGrad)
    for o in po:
        o.zero_grad()
    model(*data[2]).backward()
    norm = torch.linalg.vector_norm(model.emb.weight.grad, 2)
    assert torch.allclose(norm, torch.linalg.vector_norm(expected._values()), rtol=1e-6, atol=0)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    assert total > 0.01
    assert torch.allclose(model.emb.weight.grad.coalesce()._values(), expected._values() * (0.01 / (total + 1e-6)),
                          rtol=1e-5, atol=0)


def test_the_gradient_is_the_unwrapped_sparse_gradient():
    ref = Recommender()
    model = wrap(copy.deepcopy(ref))
    data = batches(1)[0]
    ref(*data).backward()
    model(*data).backward()
    for name in ("emb", "bag"):
        a, b = getattr(ref, name).weight.grad, getattr(model, name).weight.grad
        assert isinstance(b, RowGrad)
        b = b.coalesce()
        assert torch.equal(a.coalesce().indices(), b.indices()) and torch.equal(a.coalesce().values(), b.values())


def test_changed_rows_stay_cached_and_every_read_sees_them():
    """[Note: write-back of cached rows]: with a cache that holds every row, training writes no row to the
    host tables; reads of the weight and of the optimizer's state (a direct read, state_dict, torch.save,
    deepcopy) write the changes back first; an outside write to a state table reaches the next update."""
    make = SPARSE["adagrad"]
    data = batches(8, ids_range=120, bag_range=60)
    ref = Recommender()
    model = wrap(copy.deepcopy(ref), row_cache=10**6)
    ro, po = sparse_optimizers(ref, make), sparse_optimizers(model, make)
    p = pager.of(model)
    train(ref, ro, data[:3])
    train(model, po, data[:3])
    s = p.stats()
    assert s.row_d2h_bytes == 0 and s.row_flushes == 0 and s.row_hits > 0
    table = p.row_tables[0]
    assert not torch.equal(table.host, ref.emb.weight.detach())  # (the changes are in the cache only)
    w, rw = model.emb.weight, ref.emb.weight
    state = po[0].state[w]["sum"]
    assert type(state) is not torch.Tensor and isinstance(state, torch.Tensor)
    assert torch.equal(state, ro[0].state[rw]["sum"])
    assert p.stats().row_flushes == 1 and torch.equal(table.host, rw.detach())
    buf = io.BytesIO()
    torch.save(po[0].state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)["state"]
    assert all(type(v) is torch.Tensor for v in saved[0].values())
    # More updates, then each way of reading sees them.
    train(ref, ro, data[3:5])
    train(model, po, data[3:5])
    assert torch.equal(w[7], rw[7])
    train(ref, ro, data[5:6])
    train(model, po, data[5:6])
    copied = copy.deepcopy(po[0].state_dict())
    assert torch.equal(copied["state"][0]["sum"], ro[0].state[rw]["sum"])
    with torch.no_grad():
        for o, m in ((ro[0], ref), (po[0], model)):
            o.state[m.emb.weight]["sum"].mul_(0.5)
    # While a tensor sharing a host table's memory lives, changes go through to it at once.
    alias, snapshot, moments = w.data, w.detach(), po[0].state[w]["sum"].numpy()
    train(ref, ro, data[6:7])
    train(model, po, data[6:7])
    assert torch.equal(alias, rw.detach()) and torch.equal(snapshot, rw.detach())
    assert torch.equal(torch.from_numpy(moments), ro[0].state[rw]["sum"])
    del alias, snapshot, moments
    train(ref, ro, data[7:])
    train(model, po, data[7:])
    assert_same(ref, model)
    assert torch.equal(po[0].state[w]["sum"], ro[0].state[rw]["sum"])


def test_changed_rows_are_written_back_when_they_leave_the_cache():
    """A cache smaller than the rows a few steps touch: dirty rows leave it written back, and rows read
    again come back with their changes (SparseAdam: two state columns beside the weight's)."""
    make = SPARSE["sparse_adam"]
    data = batches(8, ids_range=400, bag_range=200)
    ref = Recommender()
    model = wrap(copy.deepcopy(ref), row_cache=60 * (DIM * 4 * 3 + 17) + 4 * (ROWS + 1))
    ro, po = sparse_optimizers(ref, make), sparse_optimizers(model, make)
    train(ref, ro, data[:2])
    train(model, po, data[:2])  # (the first step writes its rows through: it makes the state columns)
    p = pager.of(model)
    p.reset()
    train(ref, ro, data[2:])
    train(model, po, data[2:])
    s = p.stats()
    assert all(t.cache.capacity < 60 for t in p.row_tables) and s.row_d2h_bytes > 0 and s.row_flushes == 0
    assert_same(ref, model)


def test_checkpoint_round_trip_and_resume():
    make = SPARSE["sparse_adam"]
    data = batches(6)
    ref, model, ro, po = trained_pair(make, data[:3])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": [o.state_dict() for o in po]}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    assert all(type(v) is torch.Tensor for v in ckpt["model"].values())
    fresh = wrap(Recommender())
    fresh.load_state_dict(ckpt["model"])
    fo = sparse_optimizers(fresh, make)
    for o, sd in zip(fo, ckpt["opt"]):
        o.load_state_dict(sd)
    train(ref, ro, data[3:])
    train(fresh, fo, data[3:])
    assert_same(ref, fresh)


def test_writes_to_the_table_reach_lookups():
    """Writes from outside (in place through the Parameter, load_state_dict, through `.data`) are seen by
    the next lookup, whatever the cache held."""
    model = wrap(Recommender(), row_cache=10**6)
    ids = batches(1)[0]
    model(*ids)
    with torch.no_grad():
        model.emb.weight[ids[0][2, 1]] = 7.0
    out = model.emb(ids[0])
    assert torch.equal(out[2, 1], torch.full((DIM,), 7.0))
    data = model.emb.weight.data
    data[ids[0][2, 2]] = 5.0
    assert torch.equal(model.emb(ids[0])[2, 2], torch.full((DIM,), 5.0))
    del data
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(sd)
    assert model.emb(ids[0]).abs().sum() == 0


@pytest.mark.parametrize("cache", [0, 40 * DIM * 4])
@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
def test_rows_read_ahead_give_the_same_values(opt, cache):
    """expect_rows of the next batch between a forward and its backward: the step then writes rows the
    read ahead holds (consecutive batches share rows: small ranges), and those are read again."""
    data = batches(6, ids_range=120, bag_range=60)
    ref = Recommender()
    model = wrap(copy.deepcopy(ref), row_cache=cache)
    ro, po = sparse_optimizers(ref, SPARSE[opt]), sparse_optimizers(model, SPARSE[opt])
    train(ref, ro, data)
    train_reading_ahead(model, po, data, lambda batch: (batch[0], batch[1].int()))
    assert_same(ref, model)
    assert pager.of(model).stats().row_ahead_hits > 0


def train_reading_ahead(model, opts, data, ahead):
    """Train `model` on `data`, reading ahead during each step the (emb, bag) indices `ahead(next batch)`."""
    p = pager.of(model)
    for i, batch in enumerate(data):
        loss = model(*batch)
        if i + 1 < len(data):
            ids, bag_ids = ahead(data[i + 1])
            p.expect_rows(model.emb, ids)
            p.expect_rows("bag", bag_ids)
        loss.backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()


def test_rows_read_ahead_for_several_steps_see_rows_changed_in_the_cache_and_written_back():
    """expect_rows of the next two steps' lookups (two a forward): a row read ahead, taken into the cache by
    one lookup, changed there by a step and written back when a later lookup puts it out, is read again
    when a lookup after that takes it."""
    g = torch.Generator().manual_seed(9)
    data = [(torch.randint(0, 60, (3, 6), generator=g), torch.randint(0, 60, (3, 6), generator=g))
            for _ in range(12)]
    ref = TwoLookups()
    cache = 26 * (DIM * 4 * 3 + 17) + 4 * (ROWS + 1)  # about 25 rows: most leave before they come back
    model = pager.wrap(copy.deepcopy(ref), budget=10**6, device="cpu", rows=["emb"], row_cache=cache)
    opts = [torch.optim.SparseAdam(m.emb.parameters(), lr=0.01) for m in (ref, model)]
    opts += [torch.optim.SGD(m.lin.parameters(), lr=0.01) for m in (ref, model)]
    p = pager.of(model)
    for i, (ids, more) in enumerate(data):
        if i % 2 == 0:
            p.expect_rows(model.emb, torch.cat([t for pair in data[i:i + 2] for t in pair]))
        for m in (ref, model):
            m(ids, more).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    assert_same(ref, model)
    s = p.stats()
    assert s.row_ahead_hits > 0 and s.row_d2h_bytes > 0


@pytest.mark.parametrize("cache", [0, 40 * DIM * 4, 600 * DIM * 4])
@pytest.mark.parametrize("opt", sorted(SPARSE))
def test_a_lookup_of_the_tensor_read_ahead_takes_the_prepared_lookup(opt, cache, monkeypatch):
    """[Note: rows read ahead]: the lookup of the very tensor given to expect_rows takes the rows, positions
    and counts the read ahead prepared (on CUDA: no host sync), with padding and repeated rows, any cache
    size (evictions between the read and the lookup make it do its own) and the state columns of each
    optimizer; bit for bit with the unwrapped model."""
    from pager.rows.table import RowTable

    own = []  # lookups that found their rows themselves
    real = RowTable._batch_rows
    monkeypatch.setattr(RowTable, "_batch_rows", lambda self, *a: own.append(self.name) or real(self, *a))
    data = batches(8, ids_range=120, bag_range=60)
    ref = Recommender()
    model = wrap(copy.deepcopy(ref), row_cache=cache)
    ro, po = sparse_optimizers(ref, SPARSE[opt]), sparse_optimizers(model, SPARSE[opt])
    train(ref, ro, data)
    train_reading_ahead(model, po, data, lambda batch: batch[:2])  # (the very tensors the lookups take)
    assert_same(ref, model)
    s = pager.of(model).stats()
    if cache == 600 * DIM * 4:  # (a cache that holds every row: nothing moves between a read and its lookup)
        # (but the first step that makes state columns empties the cache: the second lookups find their own)
        assert own == ["emb", "bag"] * (1 if opt == "sgd" else 2) and s.row_ahead_hits > 0
    else:  # (the step writes rows through, which the rows read may hold: each lookup finds its own)
        assert len(own) == 2 * len(data)


def test_a_prepared_lookup_gives_way_to_a_changed_tensor_a_write_and_bad_rows():
    model = wrap(Recommender(), row_cache=0)
    p = pager.of(model)
    ids = torch.tensor([[5, 6, 7]])
    p.expect_rows(model.emb, ids)
    ids[0, 1] = 8  # (changed in place after the read: the lookup reads row 8)
    assert torch.equal(model.emb(ids), model.emb.weight[torch.tensor([[5, 8, 7]])])
    p.expect_rows(model.emb, ids)
    with torch.no_grad():
        model.emb.weight[8] = 7.0
    assert torch.equal(model.emb(ids)[0, 1], torch.full((DIM,), 7.0))
    bad = torch.tensor([1, 1000])
    p.expect_rows(model.emb, bad)
    with pytest.raises(IndexError, match="1000 rows"):
        model.emb(bad)
    before = model.emb.weight.detach().clone()
    p.expect_rows(model.emb, ids)
    model.emb(ids).sum().backward()  # (a prepared lookup, then the step writes rows 5, 7 and 8 through)
    torch.optim.SGD(model.emb.parameters(), lr=1.0).step()
    assert not torch.equal(model.emb.weight[[5, 7, 8]], before[[5, 7, 8]])
    p.expect_rows(model.emb, ids)
    model.emb(ids).sum().backward()
    model.emb.weight.grad = None


def test_rows_read_ahead_see_later_writes_and_bad_rows():
    model = wrap(Recommender(), row_cache=0)
    p = pager.of(model)
    ids = torch.tensor([[5, 6, 7]])
    p.expect_rows(model.emb.weight, ids)
    with torch.no_grad():
        model.emb.weight[6] = 7.0
    assert torch.equal(model.emb(ids)[0, 1], torch.full((DIM,), 7.0))
    assert model.emb(torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3, DIM)  # (no rows, no cache: nothing read)
    p.expect_rows(model.emb, torch.tensor([1, 1000, -4]))  # (read clamped to the table; the lookup checks)
    with pytest.raises(IndexError, match="1000 rows"):
        model.emb(torch.tensor([1, 1000]))
    with pytest.raises(ValueError, match="not a row table"):
        p.expect_rows(model.layers[0], ids)
    with pytest.raises(ValueError, match="'nope' is not a row table"):
        p.expect_rows("nope", ids)
    with pytest.raises(TypeError, match="int32 or int64"):
        p.expect_rows(model.emb, ids.float())


def test_the_writers_alias_of_a_host_table_stores_rows_bit_for_bit():
    """[Note: rows written back by the host]: the writer's thread stores rows through an alias of each host
    table seen as wide integers, at any row width and place in its page, bit for bit (NaN payloads and -0.0
    too), without moving the table's version counter (its stores are not writes from outside)."""
    from pager.rows.writer import host_alias

    page = torch.zeros(200, dtype=torch.float32)
    for dtype, dim, at in ((torch.float32, 16, 0), (torch.float32, 6, 4), (torch.bfloat16, 3, 2), (torch.float16, 8, 8)):
        table = page.view(torch.uint8)[at:at + 10 * dim * dtype.itemsize].view(dtype).view(10, dim)
        table.fill_(1)
        rows = torch.tensor([0, 4, 9])
        values = torch.randn(3, dim).to(dtype)
        values[0, 0], values[1, -1] = -0.0, float("nan")
        values.view(torch.int16 if dtype.itemsize == 2 else torch.int32)[2, 0] ^= 1  # (a pattern no arithmetic makes)
        alias = host_alias(table)
        version = table._version
        alias.index_copy_(0, rows, values.view(alias.dtype))
        assert table._version == version and alias.data_ptr() == table.data_ptr(), (dtype, dim, at)
        expected = torch.ones(10, dim).to(dtype)
        expected[rows] = values
        assert torch.equal(table.view(torch.uint8), expected.view(torch.uint8)), (dtype, dim, at)


def test_a_write_the_writers_thread_failed_raises_where_it_is_waited_for_or_pruned():
    """A failed store is not lost when its write is pruned as done: `query` raises it, as `wait` does."""
    from concurrent.futures import Future

    from pager.rows.writer import HostWrite

    future = Future()
    write = HostWrite(future)
    assert not write.query()
    future.set_exception(IndexError("index 10 is out of bounds"))
    for check in (write.query, write.wait):
        with pytest.raises(IndexError, match="out of bounds"):
            check()


def test_identity_class_reads_and_unwrap():
    ref = Recommender()
    model = copy.deepcopy(ref)
    weight = model.emb.weight
    wrap(model)
    assert model.emb.weight is weight and isinstance(weight, nn.Parameter) and type(weight) is RowTableParameter
    assert torch.equal(weight[5], ref.emb.weight[5]) and torch.equal(weight.sum(), ref.emb.weight.sum())
    opt = sparse_optimizers(model, SPARSE["sparse_adam"])
    train(model, opt, batches(2))
    value = weight.detach().clone()
    model(*batches(1)[0]).backward()
    pager.unwrap(model)
    assert type(weight) is nn.Parameter and torch.equal(weight, value)
    assert weight.grad.is_sparse and not isinstance(weight.grad, RowGrad)
    assert type(opt[0].state[weight]["exp_avg"]) is torch.Tensor
    copy.deepcopy(model)


def test_bad_input_is_refused_before_anything_changes():
    model = Recommender()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="not a submodule"):
        pager.wrap(model, budget=10**6, device="cpu", rows=["nope"])
    with pytest.raises(ValueError, match="nn.Embedding"):
        pager.wrap(model, budget=10**6, device="cpu", rows=["layers.0"])
    with pytest.raises(ValueError, match="row_cache"):
        pager.wrap(model, budget=10**6, device="cpu", rows=["emb"], row_cache=10**7)
    with pytest.raises(ValueError, match="rows="):
        pager.wrap(model, budget=10**6, device="cpu", rows="all")
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match="tied"):
        pager.wrap(tied, budget=10**6, device="cpu", rows=["0"])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert type(model.emb.weight) is nn.Parameter
    wrap(model)
    with pytest.raises(IndexError, match="1000 rows"):
        model.emb(torch.tensor([1, 1000]))


def test_auto_picks_tables_larger_than_a_quarter_of_the_budget():
    model = Recommender()
    budget = 4 * ROWS * DIM * 4 - 4  # the emb table is just over a quarter; the bag is under
    pager.wrap(model, budget=budget, device="cpu", rows="auto")
    assert type(model.emb.weight) is RowTableParameter and type(model.bag.weight) is not RowTableParameter
    assert [t.name for t in pager.of(model).row_tables] == ["emb"]


def test_pagers_own_threads_leave_the_shared_mode_off():
    """A thread pager starts (the row writer's on CUDA, the disk tier's) never touches a model's tensors:
    it does not put the pager in the shared mode, whose guards would serve every use of a resident block
    ([Note: tensors and threads]); a thread of the user's does."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from pager.base.common import WORKER_PREFIX

    model = wrap(Recommender())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = pager.of(model)

    def step(batch):
        model(*batch).backward()
        opt.step()
        opt.zero_grad()

    with ThreadPoolExecutor(1, thread_name_prefix=f"{WORKER_PREFIX}row-writer") as ours:
        ours.submit(lambda: None).result()  # (the thread is up, and stays until the pool closes)
        for batch in batches(2):
            step(batch)
        assert not p.shared_mode
        stop = threading.Event()
        user = threading.Thread(target=stop.wait, daemon=True)
        user.start()
        try:
            step(batches(1)[0])
            assert p.shared_mode
        finally:
            stop.set()
            user.join()


class BigTable(nn.Module):
    """A recommender whose table (1.5 MB) is far larger than its layers."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(24_000, DIM, sparse=True)
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(4)])

    def forward(self, ids):
        x = self.emb(ids).sum(1)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).sum()


def test_a_table_six_times_the_budget_is_paged_by_rows_unasked_and_trains_bit_for_bit(caplog):
    torch.manual_seed(0)
    ref = BigTable()
    model = copy.deepcopy(ref)
    table = 24_000 * DIM * 4
    with caplog.at_level("INFO", logger="pager"):
        pager.wrap(model, budget=table // 6, device="cpu")  # no rows=, no blocks=
    assert type(model.emb.weight) is RowTableParameter
    assert any("paged by rows" in r.getMessage() and "'emb'" in r.getMessage() for r in caplog.records)
    opts = [[torch.optim.SparseAdam(list(m.emb.parameters()), lr=0.01),
             torch.optim.SGD(m.layers.parameters(), lr=0.05)] for m in (ref, model)]
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, 24_000, (8, 5), generator=g)
        for m, os_ in zip((ref, model), opts):
            m(ids).backward()
            for o in os_:
                o.step()
                o.zero_grad()
    assert_same(ref, model)
    assert pager.of(model).stats().row_misses > 0
    # Asked to keep it whole (rows=[]), the same budget is refused, naming the options.
    other = BigTable()
    with pytest.raises(ValueError, match=r"rows=\['emb'\].*raise the budget|raise the budget.*rows=\['emb'\]"):
        pager.wrap(other, budget=table // 6, device="cpu", rows=[])


def test_a_table_paged_by_rows_unasked_says_when_its_optimizer_is_lazy_on_rows(caplog):
    """AdamW on a row table updates only the rows a batch touches ([Note:
    exact updates of touched rows]); where wrap chose rows itself, the user
    is told once, and not for SparseAdam or a table asked for."""
    table = 24_000 * DIM * 4
    cases = [(None, torch.optim.AdamW, True), (None, torch.optim.SparseAdam, False),
             (["emb"], torch.optim.AdamW, False)]
    for rows, make, warns in cases:
        caplog.clear()
        model = BigTable()
        pager.wrap(model, budget=table // 6, device="cpu", rows=rows)
        opt = make(list(model.emb.parameters()), lr=0.01)
        with caplog.at_level("WARNING", logger="pager"):
            pager.of(model).attach(opt)
        said = [r.getMessage() for r in caplog.records if "lazy variant" in r.getMessage()]
        assert bool(said) == warns, (rows, make, said)
        if warns:
            assert "'emb'" in said[0] and "AdamW" in said[0]
