"""pager.load from checkpoint files, the disk tier under host memory, spills
and pager.save, on the CPU device: bit for bit against the model loaded whole."""

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import pager
from helpers import assert_models_equal, assert_same
from models import TinyLM
from pager.engine.file_cache import CacheProbe
from test_training import assert_trained_alike, batches, train

safetensors = pytest.importorskip("safetensors.torch")

BIG = dict(vocab=64, d=128, n_layers=6)  # layers of ~800 KiB: their weights are read directly (O_DIRECT)


def _state(model):
    """The model's state dict as safetensors writes it: tied weights once."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd.pop("head.weight")  # tied to embed.weight, as model hubs ship it
    return sd


def _meta(**kw):
    with torch.device("meta"):
        return TinyLM(**kw)


def _layer_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.layers[0].parameters())


def _write(tmp_path, model, how):
    sd = _state(model)
    if how == "file":
        path = tmp_path / "model.safetensors"
        safetensors.save_file(sd, str(path))
        return path
    if how == "sharded":
        names = list(sd)
        half = len(names) // 2
        shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
        for file, keys in shards.items():
            safetensors.save_file({k: sd[k] for k in keys}, str(tmp_path / file))
        index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        return tmp_path
    path = tmp_path / "model.pt"
    torch.save(sd, path)
    return path


@pytest.mark.parametrize("how", ["file", "sharded", "torch_save"])
@pytest.mark.parametrize("host_budget", [None, "small"])
def test_load_matches_the_model_loaded_whole(tmp_path, how, host_budget):
    ref = TinyLM(**BIG)
    path = _write(tmp_path, ref, how)
    model = _meta(**BIG)
    params = list(model.parameters())
    hb = 3 * _layer_bytes(ref) if host_budget else None
    pager.load(model, path, budget=3 * _layer_bytes(ref) + (1 << 20), device="cpu", host_budget=hb)
    assert all(a is b for a, b in zip(params, model.parameters()))  # the very objects, now holding values
    assert model.head.weight is model.embed.weight  # tied weights stay tied
    ids = batches(1)[0][0]
    with torch.no_grad():
        for _ in range(3):
            assert_same(model(ids), ref(ids))
    s = pager.of(model).stats()
    assert s.disk_read_bytes > 0
    if host_budget:
        assert s.disk_read_bytes > 2 * sum(t.numel() * t.element_size() for t in ref.layers.parameters())
    assert_same(model.layers[3].mlp[0].weight, ref.layers[3].mlp[0].weight)  # a read outside a forward
    pager.unwrap(model)
    assert_models_equal(model, ref)


def _drop_from_page_cache(folder):
    """Write the files under `folder` out and drop them from the kernel's
    page cache, as after a reboot; skip where direct reads cannot be tested."""
    if not hasattr(os, "O_DIRECT") or not hasattr(os, "posix_fadvise"):
        pytest.skip("no O_DIRECT here")
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        try:
            os.close(os.open(os.path.join(folder, name), os.O_RDONLY | os.O_DIRECT))
        except OSError:
            pytest.skip("this filesystem refuses O_DIRECT")


@pytest.mark.parametrize("host_budget", [None, "small"])
@pytest.mark.parametrize("cache", ["just written", "dropped"])
def test_checkpoint_bytes_in_the_page_cache_are_read_from_it_and_others_direct(tmp_path, host_budget, cache):
    """[Note: files already in the page cache]: a checkpoint just written is
    copied from the cache (a direct read would go back to the drive); one the
    cache does not hold is read direct, past it. Bit for bit either way."""
    ref = TinyLM(**BIG)
    path = _write(tmp_path, ref, "sharded")
    if cache == "dropped":
        _drop_from_page_cache(tmp_path)
    else:
        fd = os.open(path / "model-00001-of-00002.safetensors", os.O_RDONLY)
        probe = CacheProbe(fd)
        answers = probe.holds(0, os.fstat(fd).st_size)
        probe.close()
        os.close(fd)
        if not answers:
            pytest.skip("the kernel does not say what its page cache holds here (not Linux)")
    model = _meta(**BIG)
    hb = 3 * _layer_bytes(ref) if host_budget else None
    pager.load(model, path, budget=3 * _layer_bytes(ref) + (1 << 20), device="cpu", host_budget=hb)
    ids = batches(1)[0][0]
    with torch.no_grad():
        for _ in range(2):
            assert_same(model(ids), ref(ids))
    s = pager.of(model).stats()
    if cache == "just written":
        assert s.disk_cached_bytes == s.disk_read_bytes > 0 and s.disk_direct_bytes == 0
    # (dropped: which reads go direct depends on what the kernel's read-ahead of the headers pulled in
    # again; the choice itself is tested below, on a range nothing else reads)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_a_range_the_page_cache_holds_is_copied_from_it_and_one_it_does_not_is_read_direct(tmp_path):
    from pager.engine.arena import aligned_empty
    from pager.engine.page_io import Files, Piece, ReadPath, read_range

    data = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8)
    path = tmp_path / "pages.bin"
    path.write_bytes(data.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        if not CacheProbe(fd).holds(0, 4096):
            pytest.skip("the kernel does not say what its page cache holds here (not Linux)")
    finally:
        os.close(fd)
    for cache, how in (("just written", ReadPath.CACHED), ("dropped", ReadPath.DIRECT)):
        if cache == "dropped":
            _drop_from_page_cache(tmp_path)
        files = Files()
        page = aligned_empty(3 << 20)[1].zero_()
        piece = Piece(0, 3 << 20, str(path), 1 << 20, padded=True)  # (bytes 1-4 MiB of the file)
        assert read_range(files, page, piece, 0, 3 << 20) == (3 << 20, how)
        assert torch.equal(page, data[1 << 20 :])
        files.close()


def test_a_range_off_the_files_alignment_is_read_direct_into_an_aligned_place(tmp_path, monkeypatch):
    """[Note: direct reads]: a tensor 8 bytes past an aligned file offset (as
    safetensors packs them) lies on an aligned place of its page, read direct
    chunk by chunk through the reading thread's bounce buffer; the page's
    bytes around it stay as they were."""
    from pager.engine import page_io
    from pager.engine.arena import aligned_empty
    from pager.engine.page_io import Files, Piece, ReadPath, read_range

    monkeypatch.setattr(page_io, "BOUNCE_BYTES", 1 << 20)  # (a tensor larger than it: read a piece at a time)
    monkeypatch.setattr(page_io, "_bounces", threading.local())
    data = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8)
    path = tmp_path / "pages.bin"
    path.write_bytes(data.numpy().tobytes())
    _drop_from_page_cache(tmp_path)
    files = Files()
    page = aligned_empty(4 << 20)[1].zero_()
    at, nbytes = (1 << 20) + 8, (3 << 20) - 8
    piece = Piece(512, nbytes, str(path), at, itemsize=2)
    assert piece.lead == 8
    for start, end in ((0, 1 << 20), (1 << 20, nbytes)):  # (two chunks, as the disk tier reads them)
        assert read_range(files, page, piece, start, end) == (end - start, ReadPath.DIRECT)
    assert torch.equal(page[512 : 512 + nbytes], data[at:])
    assert not page[:512].any() and not page[512 + nbytes :].any()
    # (a whole tensor at once, as a read outside a forward asks: through the bounce buffer a piece at a time)
    page.zero_()
    assert read_range(files, page, piece, 0, nbytes) == (nbytes, ReadPath.DIRECT)
    assert torch.equal(page[512 : 512 + nbytes], data[at:])
    assert page_io._bounces.buffer.numel() == page_io.BOUNCE_BYTES + 4096 < nbytes
    files.close()


def test_weights_read_from_files_lie_aligned_for_kernels(tmp_path):
    """Each tensor of a loaded block lies on an aligned address of its page,
    and so of its device copy, though its file offset is 8 past a 16-byte
    boundary ([Note: direct reads]: GPU kernels take slower paths on weights
    that are not)."""
    from pager.base.files import open_checkpoint

    ref = TinyLM(**BIG)
    path = tmp_path / "model.safetensors"
    for pad in range(16):  # (header bytes that put the tensors 8 past a 16-byte boundary)
        safetensors.save_file(_state(ref), str(path), metadata={"pad": "x" * pad})
        if all(e.offset % 16 == 8 for e in open_checkpoint(path).values()):
            break
    else:
        pytest.fail("no header length put the tensors 8 bytes past a 16-byte boundary")
    model = _meta(**BIG)
    pager.load(model, path, budget=3 * _layer_bytes(ref) + (1 << 20), device="cpu")
    misplaced = []

    def check(module, args):
        misplaced.extend(n for n, p in module.named_parameters() if p.data_ptr() % 64)

    for layer in model.layers:
        layer.register_forward_pre_hook(check)
    ids = batches(1)[0][0]
    with torch.no_grad():
        assert_same(model(ids), ref(ids))
    assert misplaced == []
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_regions_are_pinned_ahead_and_unwrap_or_reset_right_after_load_are_safe(tmp_path):
    """[Note: regions pinned ahead]: `pager.load` returns before the host
    memory of every page is made; `reset` (which settles) right after load
    places and reads every page, `unwrap` right after it leaves the model
    whole, and a forward meanwhile is bit for bit."""
    ref = TinyLM(**BIG)
    path = _write(tmp_path, ref, "file")
    total = sum(t.numel() * t.element_size() for t in _state(ref).values())
    ids = batches(1)[0][0]
    for then in ("reset", "unwrap", "forward"):
        model = _meta(**BIG)
        pager.load(model, path, budget=3 * _layer_bytes(ref) + (1 << 20), device="cpu")
        pg = pager.of(model)
        if then == "reset":
            pg.reset()
            assert not pg.engine.host.disks[pg]._unread
        elif then == "forward":
            with torch.no_grad():
                assert_same(model(ids), ref(ids))
            assert pg.stats().disk_read_bytes == total
        pager.unwrap(model)
        assert_models_equal(model, ref)


def test_pages_are_read_in_the_background_before_any_forward(tmp_path, monkeypatch):
    """[Note: regions pinned ahead]: with no forward to place them, the
    supply's thread places each page as its region is made and its read starts."""
    from pager.engine import arena

    monkeypatch.setattr(arena, "REGION_BYTES", 256 << 10)  # (a region a page: the supply makes several)
    ref = TinyLM(**BIG)
    path = _write(tmp_path, ref, "file")
    total = sum(t.numel() * t.element_size() for t in _state(ref).values())
    model = _meta(**BIG)
    pager.load(model, path, budget=3 * _layer_bytes(ref) + (1 << 20), device="cpu")
    pg = pager.of(model)
    deadline = time.monotonic() + 60
    while pg.counters.disk_read_bytes < total and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pg.counters.disk_read_bytes == total
    assert len(pg.engine.host.disks[pg].arena.chunks) > 3
    pg.reset()  # (from here: the forward's own counts)
    ids = batches(1)[0][0]
    with torch.no_grad():
        assert_same(model(ids), ref(ids))
    assert pg.stats().host_misses == 0 and pg.stats().disk_read_bytes == 0  # (every page was read before it)
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_a_small_model_loaded_holds_its_pages_not_a_whole_region(tmp_path):
    """Host memory near 1x the model: the regions made for a model's pages
    (pinned on CUDA: every byte touched) are as large as its pages, to a huge
    page; a pipeline's VAE of 0.2 GB held a region of 1 GiB."""
    from pager.engine.host import HUGE_PAGE_BYTES

    ref = TinyLM(**BIG)
    path = _write(tmp_path, ref, "file")
    model = _meta(**BIG)
    pager.load(model, path, budget=3 * _layer_bytes(ref) + (1 << 20), device="cpu")
    pg = pager.of(model)
    pg.reset()  # (every page placed and read)
    disk = pg.engine.host.disks[pg]
    assert 0 < disk.arena.used_bytes <= disk.arena.reserved_bytes <= disk.arena.used_bytes + HUGE_PAGE_BYTES
    ids = batches(1)[0][0]
    with torch.no_grad():
        assert_same(model(ids), ref(ids))
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_a_page_off_the_supplys_plan_is_placed_in_a_region_of_what_is_to_come():
    """A page placed off the plan (before the supply's pages) can leave a
    planned page no room: it still fits (a region made for it, no larger than
    the pages still to come), where reading ahead waited for good."""
    from pager.engine import arena

    a = arena.PageArena(None, pin=False)
    pages = [600 << 20, 600 << 20, 100 << 20, 100 << 20]
    a.expect(sum(pages) + (50 << 20))
    a.supply(pages)
    assert a.allocate(50 << 20) is not None  # (off the plan: a gradient's page, say)
    for nbytes in pages:
        deadline = time.monotonic() + 30
        while not a.fits(nbytes) and time.monotonic() < deadline:  # (its region may still be being made)
            time.sleep(0.01)
        assert a.fits(nbytes)
        assert a.allocate(nbytes) is not None
    assert a.reserved_bytes - a.used_bytes <= 100 << 20
    a.close()


def test_region_supply_plans_first_fit_and_raises_a_pinning_error_where_the_region_is_taken():
    from pager.engine import arena

    a = arena.PageArena(None, pin=False)
    # (first fit into 1 GiB regions, each then cut to the pages it takes; a larger page its own)
    a.supply([600 << 20, 600 << 20, 300 << 20, 2 << 30])
    assert [a._supply.take()[1].numel() for _ in range(3)] == [900 << 20, 600 << 20, 2 << 30]
    assert a._supply.take() is None
    a.close()

    made = arena.new_region
    calls = []

    def refuse(nbytes, pin):
        calls.append(nbytes)
        if len(calls) == 2:
            raise MemoryError("pager: test: cannot pin")
        return made(nbytes, pin)

    arena.new_region = refuse
    try:
        a = arena.PageArena(None, pin=False)
        a.supply([1 << 30, 1 << 30, 1 << 30])
        assert a.allocate(1 << 30) is not None
        with pytest.raises(MemoryError, match="cannot pin"):
            a.allocate(1 << 30)
        assert a.allocate(1 << 30) is not None  # (then made on the using thread)
        a.close()
    finally:
        arena.new_region = made


def test_non_persistent_buffers_and_cpu_tensors_keep_their_values(tmp_path):
    class WithBuffer(TinyLM):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.full((32,), 0.5), persistent=False)

        def forward(self, ids):
            return super().forward(ids) * self.scale.mean()

    ref = WithBuffer()
    path = _write(tmp_path, ref, "file")
    with torch.device("meta"):
        model = WithBuffer()
    model.scale = torch.full((32,), 0.5)  # buffers the model computes are made on the CPU
    pager.load(model, path, budget=1 << 20, device="cpu")
    ids = batches(1)[0][0]
    with torch.no_grad():
        assert_same(model(ids), ref(ids))


def _expect_refusal(model, path, match, **kw):
    before = [(n, t.device, t.dtype, t.shape) for n, t in model.state_dict().items()]
    with pytest.raises((ValueError, pager.CheckpointError), match=match):
        pager.load(model, path, budget=1 << 20, device="cpu", **kw)
    assert [(n, t.device, t.dtype, t.shape) for n, t in model.state_dict().items()] == before  # untouched
    with pytest.raises(ValueError, match="not wrapped"):
        pager.of(model)


def test_mismatched_checkpoints_are_refused_before_anything_changes(tmp_path):
    ref = TinyLM()
    sd = _state(ref)
    cases = {
        "missing": ({k: v for k, v in sd.items() if k != "layers.2.mlp.0.weight"},
                    r"missing from the checkpoint: layers\.2\.mlp\.0\.weight"),
        "extra": ({**sd, "layers.9.extra": torch.zeros(3)}, r"not in the model: layers\.9\.extra"),
        "dtype": ({**sd, "norm.weight": sd["norm.weight"].half()}, r"'norm\.weight': checkpoint F16 \[32\], model F32"),
        "shape": ({**sd, "norm.bias": torch.zeros(33)}, r"'norm\.bias': checkpoint F32 \[33\], model F32 \[32\]"),
        "no tied name": ({k: v for k, v in sd.items() if k != "embed.weight"}, r"embed\.weight = head\.weight"),
    }
    for name, (state, match) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.safetensors"
        safetensors.save_file(state, str(path))
        _expect_refusal(_meta(), path, match)
    safetensors.save_file(sd, str(tmp_path / "ok.safetensors"))
    _expect_refusal(_meta(), tmp_path / "ok.safetensors", "host_budget=.*twice|holds fewer than two",
                    host_budget=1000)
    # (compress= is read and encoded page by page: the disk tier's pages are the files' bytes)
    _expect_refusal(_meta(), tmp_path / "ok.safetensors", "compress=.*host_budget=", compress="fp8",
                    host_budget=1 << 20)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        pager.load(_meta(), tmp_path / "nothing.safetensors", budget=1 << 20, device="cpu")


def test_corrupt_and_truncated_files_are_refused_naming_file_offset_and_tensor(tmp_path):
    good = tmp_path / "good.safetensors"
    safetensors.save_file(_state(TinyLM()), str(good))
    raw = good.read_bytes()
    header_bytes = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8: 8 + header_bytes])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    cases = {
        "truncated": (raw[:-100], rf"{last!r} ends at offset {8 + header_bytes + header[last]['data_offsets'][1]}, "
                                  r"past the end of the file.*truncated"),
        "short": (raw[:5], "too short for a safetensors header"),
        "header length": ((10**9).to_bytes(8, "little") + raw[8:], "header length at offset 0 says 1000000000"),
        "header json": (raw[:8] + b"{" * header_bytes + raw[8 + header_bytes:], "JSON header .* does not parse"),
    }
    bad = dict(header)
    first = next(k for k in header if k != "__metadata__")
    bad[first] = {**header[first], "data_offsets": [header[first]["data_offsets"][0], header[first]["data_offsets"][1] + 4]}
    text = json.dumps(bad, separators=(",", ":")).encode()
    cases["sizes"] = (len(text).to_bytes(8, "little") + text + raw[8 + header_bytes:], rf"{first!r} spans offsets .* needs")
    for name, (data, match) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.safetensors"
        path.write_bytes(data)
        _expect_refusal(_meta(), path, str(path).replace(".", r"\.") + ".*" + match if name != "short" else match)
    torn = tmp_path / "torn.pt"
    torn.write_bytes(b"PK" + os.urandom(300))
    _expect_refusal(_meta(), torn, "does not load as a torch.save state dict")


def _train_from_files(tmp_path, ref, host_budget, spill, steps=6, opt_name="adam"):
    path = _write(tmp_path, ref, "file")
    model = _meta(**BIG)
    make = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-2), "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05,
                                                                                              momentum=0.9)}[opt_name]
    layer = _layer_bytes(ref)
    budget = 4 * layer + 3 * 4 * sum(p.numel() * p.element_size() for p in ref.embed.parameters()) + (1 << 20)
    pager.load(model, path, budget=budget, device="cpu", host_budget=host_budget, spill=spill)
    opt = make(model.parameters())
    data = batches(steps)
    train(model, opt, data)
    return model, opt, make, data


@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_training_with_spill_matches_unwrapped_bit_for_bit(tmp_path, opt_name):
    ref = TinyLM(**BIG)
    spill = tmp_path / "spill"
    model, opt, make, data = _train_from_files(tmp_path, copy.deepcopy(ref), 8 * _layer_bytes(ref), spill,
                                               opt_name=opt_name)
    ref_opt = make(ref.parameters())
    train(ref, ref_opt, data)
    s = pager.of(model).stats()
    assert s.spills > 0 and s.disk_write_bytes > 0 and s.evictions > 0
    assert any(f.endswith(".page") for f in os.listdir(spill))
    assert_trained_alike(model, opt, ref, ref_opt, data[0][0])
    assert not any(f.endswith(".page") for f in os.listdir(spill))  # scratch removed at unwrap


def test_training_under_a_host_budget_without_spill_says_so(tmp_path):
    ref = TinyLM(**BIG)
    with pytest.raises(MemoryError, match="spill="):
        _train_from_files(tmp_path, ref, 4 * _layer_bytes(ref), None)


def test_save_then_load_round_trip_and_other_readers(tmp_path):
    ref = TinyLM(**BIG)
    model, opt, make, data = _train_from_files(tmp_path, copy.deepcopy(ref), 8 * _layer_bytes(ref), tmp_path / "s",
                                               steps=3)
    out = pager.save(model, tmp_path / "trained.safetensors")
    ref_opt = make(ref.parameters())
    train(ref, ref_opt, data)
    loaded = safetensors.load_file(out)  # the format other readers take
    assert "head.weight" not in loaded  # tied: written once
    for k, v in ref.state_dict().items():
        if k != "head.weight":
            assert_same(loaded[k], v)
    again = _meta(**BIG)
    pager.load(again, out, budget=1 << 30, device="cpu")
    pager.unwrap(again)
    assert_models_equal(again, ref)


CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    import pager
    from models import TinyLM
    from test_training import batches, train
    import safetensors.torch as st

    torch.manual_seed(0)
    ref = TinyLM(**{big!r})
    sd = {{k: v.clone() for k, v in ref.state_dict().items() if k != "head.weight"}}
    st.save_file(sd, {src!r})
    with torch.device("meta"):
        model = TinyLM(**{big!r})
    layer = sum(p.numel() * p.element_size() for p in ref.layers[0].parameters())
    pager.load(model, {src!r}, budget=8 * layer + (1 << 20), device="cpu", host_budget=8 * layer, spill={spill!r})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = batches(40)
    train(model, opt, data[:2])
    pager.save(model, {ckpt!r})
    real_write, real_bytes, calls = os.pwritev, pager.api.load._bytes_of, [0]

    def torn_write(fd, buffers, offset):  # dies halfway through a spilled page
        calls[0] += 1
        if {where!r} == "spill" and calls[0] > 3:
            os.write(fd, bytes(buffers[0])[: len(buffers[0]) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(fd, buffers, offset)

    def torn_save(t):  # dies halfway through the next checkpoint
        calls[0] += 1
        if {where!r} == "save" and calls[0] > 20:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_bytes(t)

    os.pwritev, pager.api.load._bytes_of = torn_write, torn_save
    for i in range(2, 40):
        train(model, opt, data[i: i + 1])
        pager.save(model, {ckpt!r})
""")


@pytest.mark.parametrize("where", ["spill", "save"])
def test_a_process_killed_mid_write_leaves_the_last_checkpoint_loadable(tmp_path, where):
    src, ckpt, spill = tmp_path / "src.safetensors", tmp_path / "ckpt.safetensors", tmp_path / "spill"
    script = CHILD.format(tests=os.path.dirname(__file__), big=BIG, src=str(src), ckpt=str(ckpt), spill=str(spill),
                          where=where)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    leftovers = [f for f in os.listdir(spill if where == "spill" else tmp_path) if f.endswith(".tmp")]
    assert leftovers  # it did die mid-write
    torch.manual_seed(0)
    ref = TinyLM(**BIG)
    train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), batches(40)[:2])
    model = _meta(**BIG)
    pager.load(model, ckpt, budget=1 << 30, device="cpu")
    pager.unwrap(model)
    assert_models_equal(model, ref)


def test_plan_report_and_stats_show_the_disk_tier(tmp_path):
    ref = TinyLM(**BIG)
    path = _write(tmp_path, ref, "file")
    layer = _layer_bytes(ref)
    budget, host_budget = 3 * layer + (1 << 20), 7 * layer // 2  # (off a kept-set boundary: pages from files are a little larger)
    p = pager.plan(_meta(**BIG), budget, device="cpu", host_budget=host_budget, disk_gbps=2.0)
    assert p.host_kept and p.forward_disk_bytes > 0 and "from disk, disk floor" in str(p)
    model = pager.load(_meta(**BIG), path, budget=budget, device="cpu", host_budget=host_budget)
    ids = batches(1)[0][0]
    with torch.no_grad():
        model(ids), model(ids)
        pager.of(model).reset()
        for _ in range(3):
            model(ids)
    s = pager.of(model).stats()
    per_forward = s.disk_read_bytes / 3
    # The plan's kept set is the run's; a forward reads at most what the plan says (pages that are
    # neither kept nor evicted in time are read again; the streaming window may hold some across
    # forwards) and at least what neither host memory nor the device holds.
    disk = pager.of(model).engine.host.disks[pager.of(model)]
    assert sorted(disk.blocks[seg].name for seg in disk.kept) == p.host_kept
    device_kept = sum(n for name, n in p.blocks if name in p.kept) + p.remainder_bytes
    least = sum(n for _name, n in p.blocks) + p.remainder_bytes - host_budget - device_kept
    assert least <= per_forward <= 1.05 * p.forward_disk_bytes, (least, per_forward, p.forward_disk_bytes)
    assert s.host_hits > 0 and "disk:" in str(s)
    report = pager.of(model).report()
    assert "measured sequential peak" in report and "kept" in report


def test_models_of_one_pool_read_ahead_each_into_its_own_pages(tmp_path):
    """In a pool, a model's prefetch walks on into the next model's plan: the
    next model's pages are read ahead by that model's own disk tier (its host
    memory, its reads), never into the one prefetching, whose reads the next
    model would not know of: it took a page still being read for one read."""
    torch.manual_seed(0)
    layer = _layer_bytes(TinyLM(**BIG))
    pool = pager.Pool(budget=6 * layer + (2 << 20), device="cpu")  # (the blocks stream: prefetch runs at each use)
    models, refs = [], []
    for seed in (1, 2):
        torch.manual_seed(seed)
        ref = TinyLM(**BIG).eval()
        folder = tmp_path / str(seed)
        folder.mkdir()
        path = _write(folder, ref, "file")
        model = pager.load(_meta(**BIG), path, pool=pool, host_budget=3 * layer, name=f"m{seed}")
        models.append(model)
        refs.append(ref)
    x = torch.randint(0, BIG["vocab"], (2, 8))
    with torch.no_grad():
        for _ in range(4):  # (in turn: each model's prefetch walks on into the other's plan)
            for model, ref in zip(models, refs):
                assert_same(model(x), ref(x))
                for m in models:
                    disk = pool.engine.host.disks[pager.of(m)]
                    for seg in [*disk.pages, *disk.reading]:
                        assert seg in disk.blocks, f"{pager.of(m).name} holds a page of another model"
    for model in models:
        pager.unwrap(model)
