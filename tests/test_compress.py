"""Compressed pages (wrap(..., compress=...)): the codecs round-trip on the
weight distributions that occur and on those that do not compress, and a
paged model with compressed pages computes what the unpaged one does, bit
for bit, on the CPU device."""

import copy
import logging

import pytest
import torch

import pager
import pager.codec.compress as codec_module
from pager.base.block import layout
from pager.codec.compress import decoded_copy, encode
from helpers import assert_same, tensor_page_bytes
from models import TinyLM
from test_training import OPTIMIZERS, batches, regime_budget, train


def _bf16_patterns(n, seed=0):
    """Every bf16 bit pattern (all exponents, NaNs, infinities, subnormals, -0.0), shuffled."""
    g = torch.Generator().manual_seed(seed)
    words = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    return words[torch.randperm(words.numel(), generator=g)][:n].view(torch.bfloat16)


def _distributions():
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(512, 384, generator=g) * 0.02
    heavy = torch.distributions.StudentT(2.0).sample((300, 500)) * 0.01
    special = normal.clone().flatten()
    special[:8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-39, 3e38])
    sprinkled = normal.clone().bfloat16().flatten()
    sprinkled[::97] = _bf16_patterns(sprinkled[::97].numel())  # 1% of every pattern: escapes
    return {
        "normal": normal.bfloat16(),
        "uniform": (torch.rand(1000, 100, generator=g) - 0.5).bfloat16(),
        "heavy tails": heavy.bfloat16(),
        "specials": special.view(512, 384).bfloat16(),
        "every pattern, sprinkled": sprinkled.view(512, 384),
        "transposed": (torch.randn(256, 320, generator=g) * 0.05).bfloat16().t(),
        "odd length": (torch.randn(4099, generator=g) * 0.1).bfloat16().view(4099, 1),
    }


def _segment(named):
    slots, nbytes = layout(named)
    plain = torch.zeros(nbytes, dtype=torch.uint8)
    for slot, (_n, t) in zip(slots, named):
        slot.view_of(plain).copy_(t)
    return slots, plain


@pytest.mark.parametrize("name", list(_distributions()))
def test_lossless_round_trip_bit_for_bit(name):
    t = _distributions()[name]
    named = [("w", t), ("norm", torch.ones(64, dtype=torch.bfloat16)), ("count", torch.tensor([7]))]
    slots, plain = _segment(named)
    encoded, page = encode("lossless", slots, plain)
    assert [p.kind for p in encoded.pieces] == ["exp4", "raw"], name  # the small tensors are raw
    assert encoded.page_bytes < 0.8 * plain.numel(), (name, encoded.page_bytes / plain.numel())
    out = decoded_copy(page, encoded)
    for slot, (_n, t) in zip(slots, named):
        got = slot.view_of(out)
        assert got.stride() == t.stride()
        assert torch.equal(got.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), name
    if name in ("specials", "every pattern, sprinkled"):
        assert encoded.pieces[0].escapes > 0


def test_data_that_does_not_compress_stays_plain():
    g = torch.Generator().manual_seed(0)
    noise = _bf16_patterns(1 << 16).view(256, 256)  # every exponent equally often
    slots, plain = _segment([("w", noise)])
    assert encode("lossless", slots, plain) is None
    # Beside a tensor that compresses, it stays raw and the rest is coded.
    slots, plain = _segment([("w", noise), ("v", (torch.randn(512, 512, generator=g) * 0.02).bfloat16())])
    encoded, page = encode("lossless", slots, plain)
    assert [p.kind for p in encoded.pieces] == ["raw", "exp4"]
    assert torch.equal(decoded_copy(page, encoded)[: plain.numel()], plain)


@pytest.mark.parametrize("codec", ["lossless", "fp8", "int4"])
def test_pieces_split_large_tensors_and_decode_the_same(codec, monkeypatch):
    t = (torch.randn(300, 257) * 0.03).bfloat16()
    named = [("a", t), ("b", torch.randn(40, 40))]
    slots, plain = _segment(named)
    whole, whole_page = encode(codec, slots, plain)
    monkeypatch.setattr(codec_module, "PIECE_BYTES", 4096)
    split, split_page = encode(codec, slots, plain)
    assert len(split.pieces) > 5 * len(whole.pieces)
    assert torch.equal(decoded_copy(split_page, split), decoded_copy(whole_page, whole))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_lossy_codecs_error_bounds(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.distributions.StudentT(3.0).sample((200, 256)) * 0.02).to(dtype)
    named = [("w", x), ("bias", torch.randn(256).to(dtype)), ("ids", torch.arange(10))]
    slots, plain = _segment(named)
    xf = x.float().flatten()
    for codec in ("fp8", "int4"):
        encoded, page = encode(codec, slots, plain)
        assert [p.kind for p in encoded.pieces] == [codec, "raw"]
        out = decoded_copy(page, encoded)
        got = slots[0].view_of(out).float().flatten()
        err = (got - xf).abs()
        if codec == "fp8":
            # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormals spaced 2^-9 of the scale.
            scale = xf.view(-1, 128).abs().amax(1).repeat_interleave(128) / 448
            bound = xf.abs() * (2.0 ** -4 + 2.0 ** -8) + scale * 2.0 ** -9  # (+ the rounding to dtype)
            ratio = 0.55
        else:
            g64 = xf.view(-1, 64)
            step = ((g64.amax(1) - g64.amin(1)) / 15).repeat_interleave(64)
            bound = 0.51 * step * (1 + 2.0 ** -7) + 2.0 ** -9 * xf.abs() + 2 * xf.abs().max() * 2.0 ** -8
            ratio = 0.32 if dtype != torch.float32 else 0.17
        assert bool((err <= bound + 1e-12).all()), (codec, dtype, (err - bound).max())
        assert encoded.page_bytes < ratio * plain.numel(), (codec, dtype, encoded.page_bytes / plain.numel())
        for slot, (_n, t) in list(zip(slots, named))[1:]:
            assert torch.equal(slot.view_of(out), t)  # 1-D and integer tensors are exact


def test_lossy_keeps_tensors_with_nonfinite_values_exact():
    x = (torch.randn(64, 64) * 0.02).bfloat16()
    x[3, 5] = float("inf")
    slots, plain = _segment([("w", x), ("v", (torch.randn(64, 64) * 0.02).bfloat16())])
    encoded, page = encode("int4", slots, plain)
    assert [p.kind for p in encoded.pieces] == ["raw", "int4"]
    assert torch.equal(slots[0].view_of(decoded_copy(page, encoded)), x)


def _lm(dtype=torch.bfloat16):
    return TinyLM(vocab=256, d=64, n_layers=6).to(dtype)


def _streaming_budget(model):
    """The remainder and 2.5 layers: every forward streams most layers."""
    return int(2.5 * tensor_page_bytes(model.layers[0])) + tensor_page_bytes(model.embed) + 4096


@pytest.mark.parametrize("prefetch", [0, 2])
def test_lossless_paged_forward_equals_unpaged_bit_for_bit(prefetch):
    model = _lm()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=_streaming_budget(model), device="cpu", compress="lossless", prefetch=prefetch)
    s = pager.of(model).stats()
    assert s.compressed_blocks == len(model.layers)
    assert s.page_bytes < 0.85 * s.plain_page_bytes
    for seed in range(3):
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            assert_same(model(ids), ref(ids))
    s = pager.of(model).stats()
    assert s.evictions > 0
    # What crossed the "link" is the compressed pages.
    layer_pages = [b.weights.page_bytes for b in pager.of(model).all_blocks()]
    assert s.h2d_bytes == sum(b.fetches * n for b, n in zip(s.blocks, layer_pages))
    assert_same(model.state_dict()["layers.2.mlp.0.weight"], ref.state_dict()["layers.2.mlp.0.weight"])
    pager.unwrap(model)
    for (name, a), (_n, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("codec", ["fp8", "int4"])
def test_lossy_paged_forward_equals_the_model_with_decoded_weights(codec):
    model = _lm()
    original = copy.deepcopy(model)
    pager.wrap(model, budget=_streaming_budget(model), device="cpu", compress=codec)
    decoded = model.state_dict()
    ref = copy.deepcopy(original)
    ref.load_state_dict(decoded)
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        out, want, exact = model(ids), ref(ids), original(ids)
        assert_same(out, want)
        assert_same(model(ids), want)  # again, every layer fetched once more
    # The weights did change (a lossy code), by a little.
    w, w0 = decoded["layers.0.mlp.0.weight"].float(), original.state_dict()["layers.0.mlp.0.weight"].float()
    assert 0 < (w - w0).abs().max() < 0.1 * w0.abs().max()
    assert (out.float() - exact.float()).abs().max() < 0.25 * exact.float().abs().max()
    pager.unwrap(model)
    for name, value in model.state_dict().items():
        assert torch.equal(value, decoded[name]), name


def test_training_with_compressed_pages_matches_unwrapped_and_pages_turn_plain(caplog):
    caplog.set_level(logging.WARNING, logger="pager")
    model = TinyLM().bfloat16()
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=regime_budget(model, "streams"), device="cpu", compress="lossless")
    assert pager.of(model).stats().compressed_blocks == len(model.layers)
    opt, ref_opt = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](ref.parameters())
    train(model, opt, batches(6))
    train(ref, ref_opt, batches(6))
    s = pager.of(model).stats()
    # Pages that left after a step were stored plain (those kept on the device may still be compressed).
    assert s.compressed_blocks < len(model.layers) and s.evictions > 0
    assert "its compressed page is replaced by a plain one" in caplog.text
    pager.unwrap(model)
    for (name, a), (_n, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name


def test_load_state_dict_into_compressed_pages():
    model = _lm()
    ref = _lm()
    pager.wrap(model, budget=_streaming_budget(model), device="cpu", compress="lossless")
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert_same(model(ids), ref(ids))
        assert_same(model(ids), ref(ids))
    assert pager.of(model).stats().compressed_blocks < len(model.layers)


def test_models_without_bf16_weights_stay_plain_under_lossless():
    model = _lm(torch.float16)
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=_streaming_budget(model), device="cpu", compress="lossless")
    assert pager.of(model).stats().compressed_blocks == 0
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert_same(model(ids), ref(ids))


def test_fp32_model_with_fp8_pages():
    model = _lm(torch.float32)
    original = copy.deepcopy(model)
    pager.wrap(model, budget=_streaming_budget(model), device="cpu", compress="fp8")
    s = pager.of(model).stats()
    assert s.compressed_blocks == len(model.layers) and s.page_bytes < 0.35 * s.plain_page_bytes  # (the remainder is plain)
    ref = copy.deepcopy(original)
    ref.load_state_dict(model.state_dict())
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert_same(model(ids), ref(ids))


def test_a_codec_that_does_not_exist_is_refused_before_anything_changes():
    model = _lm()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"compress='zstd' is not a codec.*\"lossless\""):
        pager.wrap(model, budget=1 << 20, device="cpu", compress="zstd")
    with pytest.raises(ValueError, match="not wrapped"):
        pager.of(model)
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]) and type(t) is torch.Tensor


def test_compressed_stats_are_reported():
    model = _lm()
    pager.wrap(model, budget=_streaming_budget(model), device="cpu", compress="int4")
    s = pager.of(model).stats()
    assert f"{s.compressed_blocks} blocks' weights compressed" in str(s)
    assert s.page_bytes < 0.4 * s.plain_page_bytes


def test_compressed_models_split_only_parts_whose_page_is_worth_a_use():
    """[Note: compressed pages]: a part split off a block costs a use's host
    work; under compression only parts with a large page are split off."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
                                     for _ in range(6)]).bfloat16()

    budget = 3 * tensor_page_bytes(model()[0])
    plain, packed = model(), model()
    pager.wrap(plain, budget=budget, device="cpu")
    pager.wrap(packed, budget=budget, device="cpu", compress="lossless")
    assert sum(b.part for b in pager.of(plain).blocks) == 12  # 2 MiB parts: split as before
    assert sum(b.part for b in pager.of(packed).blocks) == 0
    x = torch.randn(4, 1024).bfloat16()
    with torch.no_grad():
        assert_same(packed(x), plain(x))


def test_models_with_different_codecs_share_a_pool():
    plain, lossless, lossy = _lm(), _lm(), _lm()
    refs = [copy.deepcopy(m) for m in (plain, lossless)]
    pool = pager.Pool(budget=2 * _streaming_budget(plain), device="cpu")
    pager.wrap(plain, pool=pool, name="plain")
    pager.wrap(lossless, pool=pool, name="lossless", compress="lossless")
    pager.wrap(lossy, pool=pool, name="int4", compress="int4")
    lossy_ref = _lm()
    lossy_ref.load_state_dict(lossy.state_dict())
    refs.append(lossy_ref)
    for step in range(6):
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
        for model, ref in zip((plain, lossless, lossy), refs):
            with torch.no_grad():
                assert_same(model(ids), ref(ids))
    s = pool.stats()
    assert s.models["lossless"].compressed_blocks == 6 and s.models["int4"].compressed_blocks == 6
    assert s.models["plain"].compressed_blocks == 0 and s.peak_resident_bytes <= pool.budget_bytes
    assert s.models["int4"].h2d_bytes < 0.4 * s.models["plain"].h2d_bytes
    pager.unwrap(lossless)
    assert_same(lossless.state_dict()["layers.3.attn.qkv.weight"], refs[1].state_dict()["layers.3.attn.qkv.weight"])


def test_consecutive_matrices_are_coded_as_one_run():
    g = torch.Generator().manual_seed(0)
    mats = [(f"w{i}", (torch.randn(100 + i, 77, generator=g) * 0.02).bfloat16()) for i in range(5)]
    named = mats[:3] + [("norm", torch.ones(77, dtype=torch.bfloat16))] + mats[3:]
    slots, plain = _segment(named)
    for codec in ("lossless", "fp8", "int4"):
        encoded, page = encode(codec, slots, plain)
        kind = "exp4" if codec == "lossless" else codec
        assert [p.kind for p in encoded.pieces] == [kind, "raw", kind], codec  # a run, the norm, a run
        out = decoded_copy(page, encoded)
        if codec == "lossless":
            for slot, (_n, t) in zip(slots, named):
                assert torch.equal(slot.view_of(out), t)
    # Wide exponent ranges far apart: one table would escape much of each; a table each.
    cauchy = torch.distributions.StudentT(1.0)
    far = [("small", (cauchy.sample((300, 64)) * 1e-10).bfloat16()),
           ("large", (cauchy.sample((300, 64)) * 1e10).bfloat16())]
    slots, plain = _segment(far)
    encoded, page = encode("lossless", slots, plain)
    assert [p.kind for p in encoded.pieces] == ["exp4", "exp4"]
    assert encoded.page_bytes < 0.8 * plain.numel()
    assert torch.equal(decoded_copy(page, encoded), plain)


@pytest.mark.parametrize("codec", ["lossless", "fp8", "int4"])
def test_plan_knows_compress_bytes_a_forward_moves(codec):
    """`plan(..., compress=)` estimates a forward's bytes at the codec's
    usual ratio: within 15% of what the wrapped model moves."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).bfloat16().eval()
    for layer in model:
        torch.nn.init.normal_(layer.weight, std=0.02)
    budget = 3 * tensor_page_bytes(model[0])
    p = pager.plan(model, budget, device="cpu", compress=codec)
    plain = pager.plan(model, budget, device="cpu")
    assert p.forward_bytes < plain.forward_bytes and "compress" in str(p)
    pager.wrap(model, budget=budget, device="cpu", compress=codec)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        model(x)
        model(x)
        pager.of(model).reset()
        model(x)
    moved = pager.of(model).stats().h2d_bytes
    assert abs(p.forward_bytes - moved) <= 0.15 * moved, (p.forward_bytes, moved)
