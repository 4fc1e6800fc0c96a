"""Mixture-of-experts layers whose experts page one by one ([Note: experts
paged one by one] in experts/table.py): transformers' own models on the CPU
device, bit for bit under each experts implementation, only the routed
experts moved."""

import contextlib
import threading

import pytest
import torch

import pager
from pager.base.common import dry_running
from pager.experts import cache as cache_module
from pager.experts.cache import ExpertCache
from pager.experts.chunks import token_groups

transformers = pytest.importorskip("transformers")

IMPLEMENTATIONS = ["eager", "batched_mm", "grouped_mm"]


def _mixtral():
    return transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip


def _qwen3_moe():  # a dense layer between MoE ones
    return transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        mlp_only_layers=[1], max_position_embeddings=64,
    )  # fmt: skip


def _deepseek_v3():  # a dense first layer, shared experts, grouped routing
    return transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
    )  # fmt: skip


def _gpt_oss():  # biases, transposed experts, the routing named `router_indices`
    return transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip


CONFIGS = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3, "gpt_oss": _gpt_oss}


def _pair(kind, implementation="grouped_mm"):
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
    with torch.no_grad():  # (DeepSeek's routing correction, small: its routing follows the tokens still)
        for m in ref.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0.0, 0.01)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
    model.load_state_dict(ref.state_dict())
    for m in (ref, model):
        m.set_experts_implementation(implementation)
    return ref, model


def _experts(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


def _one_layer(model) -> int:
    """Bytes of one layer's experts: the least cache, so that experts leave it."""
    e = _experts(model)[0]
    return sum(p.numel() * p.element_size() for p in e.parameters())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_experts_page_one_by_one_bit_for_bit(kind, implementation):
    ref, model = _pair(kind, implementation)
    params = {n: p for n, p in model.named_parameters()}
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=3 * _one_layer(model) // 2)
    p = pager.of(model)
    assert len(p.expert_tables) == len(_experts(model)) >= 2
    in_blocks = {id(t) for b in p.all_blocks() for seg in b.segments.values() for t in seg.tensors}
    assert not any(id(q) in in_blocks for e in _experts(model) for q in e.parameters())
    assert all(t.cache.capacity == 12 for t in p.expert_tables)  # (a layer and a half: experts come and go)
    ids = torch.randint(0, 64, (3, 7))
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(ids).logits, ref(ids).logits)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0))
    s = p.stats()
    assert s.expert_hits > 0 and s.expert_misses > 0
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    for e in _experts(model):
        assert e.gate_up_proj.device.type == "cpu" and e.num_experts == 8
    pager.unwrap(model)
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), n


def test_a_decode_token_moves_at_most_its_routed_experts():
    ref, model = _pair("qwen3_moe", "batched_mm")
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model))
    p, ids = pager.of(model), torch.randint(0, 64, (1, 5))
    e = p.expert_tables[0]
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)  # (the prompt: every expert)
        before, new = p.stats().expert_h2d_bytes, 12
        out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
    moved = p.stats().expert_h2d_bytes - before
    routed = (5 + new) * len(p.expert_tables) * 2 * e.expert_bytes  # k = 2 of 8, each layer, each position
    every = (1 + new) * sum(t.num_experts * t.expert_bytes for t in p.expert_tables)  # what a layer block moves
    assert 0 < moved <= routed < every
    assert torch.equal(out, ref.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_from_pretrained_pages_experts_one_by_one(tmp_path, kind):
    torch.manual_seed(0)
    saved = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]())
    saved.save_pretrained(tmp_path / kind, max_shard_size="40KB")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / kind).eval()
    model = pager.from_pretrained(tmp_path / kind, budget=10 << 20, device="cpu", expert_cache=_one_layer(ref))
    assert pager.of(model).expert_tables
    ids = torch.randint(0, 64, (2, 6))
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
    assert pager.of(model).stats().expert_misses > 0


def test_a_budget_without_room_for_a_tokens_experts_is_refused_unchanged():
    _ref, model = _pair("mixtral")
    token = 2 * _one_layer(model) // 8  # (2 of 8 experts routed)
    before = {n: (p, p.device, p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"need a cache of .* at least .* Raise the budget to .* experts=None"):
        pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=token - 1)
    with pytest.raises(ValueError, match="Raise the budget to"):
        pager.wrap(model, budget=token, device="cpu")
    for n, p in model.named_parameters():
        assert p is before[n][0] and p.device == before[n][1] and torch.equal(p, before[n][2]), n
    assert not _experts(model)[0]._forward_pre_hooks
    pager.wrap(model, budget=10 << 20, device="cpu")  # (and it can still be wrapped)


def test_trained_experts_under_master_weights_are_refused_and_left_usable():
    ref, model = _pair("qwen3_moe")
    for m in (ref, model):
        m.to(torch.bfloat16)
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model), master_weights=True)
    ids = torch.randint(0, 64, (2, 5))
    with pytest.raises(RuntimeError, match=r"train on the host, without float32 master weights.*experts=None"):
        model(ids)
    for e in _experts(model):
        assert e.gate_up_proj.shape[0] == e.num_experts == 8 and e.gate_up_proj.device.type == "cpu"
        assert e._parameters["gate_up_proj"] is e.gate_up_proj and isinstance(e.gate_up_proj, torch.nn.Parameter)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_experts_none_pages_them_with_their_layer_and_a_wrong_name_is_refused():
    ref, model = _pair("mixtral")
    with pytest.raises(ValueError, match=r"experts= names 'model.layers.0.mlp.gate'.* cannot be paged by expert"):
        pager.wrap(model, budget=10 << 20, device="cpu", experts=["model.layers.0.mlp.gate"])
    with pytest.raises(ValueError, match="not a module of this model"):
        pager.wrap(model, budget=10 << 20, device="cpu", experts=["nowhere"])
    pager.wrap(model, budget=10 << 20, device="cpu", experts=None)
    assert not pager.of(model).expert_tables
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_experts_named_one_by_one_and_written_after_wrap():
    ref, model = _pair("mixtral", "eager")
    named = [n for n, m in model.named_modules() if type(m).__name__ == "MixtralExperts"][:1]
    pager.wrap(model, budget=10 << 20, device="cpu", experts=named)
    assert [t.name for t in pager.of(model).expert_tables] == named
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        model(ids)
        for m in (model, ref):  # a write from outside a forward: the cached copies are stale
            m.get_submodule(named[0]).down_proj.mul_(-0.5)
        assert torch.equal(model(ids).logits, ref(ids).logits)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    state[f"{named[0]}.gate_up_proj"].add_(1.0)
    model.load_state_dict(state)
    ref.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_the_cache_keeps_experts_used_again_over_experts_used_once():
    cache = ExpertCache((((2,), torch.float32),), 4, torch.device("cpu"))
    filled = []

    def fill(slot, key):
        cache.tensors[0][slot].fill_(key)
        filled.append(key)

    cache.hold(0, [0, 1], fill)
    cache.hold(0, [0, 1], fill)  # used again: protected
    for once in range(10, 20):  # a stream of experts used once each
        slots, missed = cache.hold(0, [once], fill)
        assert missed == 1 and cache.tensors[0][slots[0]][0] == once
    slots, missed = cache.hold(0, [0, 1], fill)
    assert missed == 0 and [cache.tensors[0][s][0].item() for s in slots] == [0, 1]
    assert filled == [0, 1, *range(10, 20)]
    slots, missed = cache.hold(0, [2, 3, 4, 5], fill)  # a call of the cache's size: all of it goes
    assert missed == 4 and sorted(slots) == [0, 1, 2, 3]


def test_experts_cycled_through_more_than_the_cache_keep_a_fixed_set():
    """A token's experts over all layers outnumber the slots (the Mixtral
    shape under its budget), every one used alike: least recently used
    alone would hit none; the counts keep a fixed set, hit every round."""
    cache = ExpertCache((((2,), torch.float32),), 8, torch.device("cpu"))  # (6 kept, 2 for a call's misses)
    rounds = []
    for _ in range(6):
        missed = sum(cache.hold(0, [e, e + 1], lambda slot, key: None, per_token=2)[1] for e in range(0, 16, 2))
        rounds.append(missed)
    assert rounds[0] == 16 and rounds[-3:] == [10, 10, 10]  # (6 slots kept, 2 for a call's misses)


def test_copies_ahead_never_push_out_experts_kept_for_their_counts():
    cache = ExpertCache((((2,), torch.float32),), 8, torch.device("cpu"))
    for _ in range(3):
        for e in range(0, 8, 2):
            cache.hold(0, [e, e + 1], lambda slot, key: None, per_token=2)
    kept = dict(cache._frequent)
    assert len(kept) == 6
    taken = cache.take_ahead(0, [20, 21, 22], protect=set())
    assert [key for _slot, key in taken] == [20, 21]  # (the two recent slots only)
    assert cache._frequent == kept


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_experts_page_one_by_one_on_the_gpu(implementation):
    ref, model = _pair("mixtral", implementation)
    ref.cuda()
    pager.wrap(model, budget=16 << 20, device="cuda", expert_cache=3 * _one_layer(model) // 2)
    e = pager.of(model).expert_tables[0]
    assert e.hosts[0].is_pinned() and e.cache.tensors[0].is_cuda
    ids = torch.randint(0, 64, (3, 7), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0))
    assert pager.of(model).stats().expert_misses > 0
    pager.unwrap(model)
    assert e.hosts[0].device.type == "cpu" and _experts(model)[0].gate_up_proj.device.type == "cpu"


def test_two_threads_share_the_experts_cache():
    ref, model = _pair("mixtral", "batched_mm")
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model))  # (slots taken in turn)
    batches = [torch.randint(0, 64, (2, 5 + i)) for i in range(2)]
    with torch.no_grad():
        want = [ref(ids).logits for ids in batches]
    got: dict = {}

    def run(i):
        with torch.no_grad():
            got[i] = [model(batches[i]).logits for _ in range(6)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert all(torch.equal(out, want[i]) for out in got[i])


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_decode_token_fetches_the_next_layers_experts_ahead(kind):
    """[Note: experts fetched ahead]: each layer's call copies the experts the
    next layer's router would choose for its hidden states; the next call
    uses most of them, and the tokens are the unpaged model's."""
    ref, model = _pair(kind, "batched_mm")
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model) * 3 // 2)
    p = pager.of(model)
    assert [t.next for t in p.expert_tables] == [*p.expert_tables[1:], None]
    assert all(t.router is not None for t in p.expert_tables)
    ids = torch.randint(0, 64, (1, 4))
    kw = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    out = model.generate(ids, **kw)
    assert torch.equal(out, ref.generate(ids, **kw))
    s = p.stats()
    assert 0 < s.expert_ahead_used <= s.expert_ahead
    # (the predictor is the next router on this layer's input: right more often than a draw of k of 8)
    assert s.expert_ahead_used > s.expert_ahead * 2 / 8


def test_experts_fetched_ahead_follow_a_changed_router():
    ref, model = _pair("mixtral", "batched_mm")
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model) * 3 // 2)
    table = pager.of(model).expert_tables[1]
    ids = torch.randint(0, 64, (1, 4))
    model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    before = table.router.weight.clone()
    with torch.no_grad():
        for m in (model, ref):
            m.model.layers[1].mlp.gate.weight.mul_(-1.0)
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(table.router.weight, -before)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))


def test_fetching_ahead_pauses_where_the_routing_cannot_be_predicted(monkeypatch):
    """Routing drawn at random: the next router predicts it at chance, and
    the copies ahead would only crowd the cache: after a window of them,
    few used, fetching ahead stops ([Note: experts fetched ahead])."""
    monkeypatch.setattr(cache_module, "AHEAD_WINDOW", 16)
    monkeypatch.setattr(cache_module, "AHEAD_PAUSE_CALLS", 10_000)
    ref, model = _pair("mixtral", "batched_mm")
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model) * 3 // 2)
    p = pager.of(model)
    g = torch.Generator().manual_seed(0)

    def drawn(module, args, out):  # (a router whose choice is a draw)
        logits, scores, index = out
        return logits, scores, torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(len(index))])

    for m in (model, ref):
        for layer in m.model.layers:
            layer.mlp.gate.register_forward_hook(drawn)
    ids, kw = torch.randint(0, 64, (1, 4)), {"max_new_tokens": 30, "min_new_tokens": 30, "do_sample": False}
    g.manual_seed(0)
    out = model.generate(ids, pad_token_id=0, **kw)
    g.manual_seed(0)
    assert torch.equal(out, ref.generate(ids, pad_token_id=0, **kw))
    s = p.stats()
    assert 16 <= s.expert_ahead < 16 + 2 * 2  # (one window, and the call that closed it)
    assert s.expert_ahead_used < s.expert_ahead / 2
    assert p.expert_tables[0].cache.ahead_paused > 0


def test_a_wrap_that_fails_midway_leaves_the_model_as_it_was(monkeypatch):
    from pager.model import build

    ref, model = _pair("mixtral")
    made = []

    def second_fails(*args, **kwargs):
        if made:
            raise RuntimeError("no room for the second experts module's host tensors")
        made.append(build.ExpertTable.__wrapped__(*args, **kwargs))
        return made[-1]

    second_fails.__wrapped__ = build.ExpertTable  # type: ignore[attr-defined]
    monkeypatch.setattr(build, "ExpertTable", second_fails)
    with pytest.raises(RuntimeError, match="no room"):
        pager.wrap(model, budget=10 << 20, device="cpu")
    monkeypatch.undo()
    first = _experts(model)[0]
    assert not first._forward_pre_hooks and not first._forward_hooks
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    pager.wrap(model, budget=10 << 20, device="cpu")  # (and it wraps again)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_a_pre_hook_before_pagers_that_fails_leaves_the_experts_as_they_were():
    ref, model = _pair("mixtral")
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model))
    experts, table = _experts(model)[0], pager.of(model).expert_tables[0]

    def refuses(module, args):
        raise ValueError("a hook of the user's refuses")

    handle = experts.register_forward_pre_hook(refuses, prepend=True)
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad(), pytest.raises(ValueError, match="refuses"):
        model(ids)
    handle.remove()
    assert table._calls == {}
    took: list = []

    def take():
        took.append(table.cache.lock.acquire(timeout=5))
        if took[-1]:
            table.cache.lock.release()

    other = threading.Thread(target=take)
    other.start()
    other.join()
    assert took == [True]  # (no lock left held, none released that was not taken)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_call_of_no_tokens(implementation):
    ref, model = _pair("qwen3_moe", implementation)
    pager.wrap(model, budget=10 << 20, device="cpu")
    hidden, index = torch.zeros(0, 32), torch.zeros(0, 2, dtype=torch.long)
    with torch.no_grad():
        got = _experts(model)[0](hidden, index, torch.zeros(0, 2))
        assert torch.equal(got, _experts(ref)[0](hidden, index, torch.zeros(0, 2)))
    # (with gradients through it: what its forward saves is made again, or kept, for the backward)
    for m in (model, ref):
        m.requires_grad_(False)
    grads = []
    for m in (model, ref):
        h = torch.zeros(0, 32, requires_grad=True)
        out = _experts(m)[0](h, index, torch.zeros(0, 2))
        if out.requires_grad:  # (eager's output of no tokens is none of the input's)
            out.sum().backward()
        grads.append((out.requires_grad, h.grad))
    assert grads[0][0] == grads[1][0] and (grads[0][1] is None) == (grads[1][1] is None)
    if grads[0][1] is not None:
        assert torch.equal(grads[0][1], grads[1][1])


def test_experts_of_models_sharing_a_pool_stay_within_its_budget():
    pool = pager.Pool(budget=700_000, device="cpu")
    refs, models = zip(*[_pair("mixtral") for _ in range(2)])
    for m in models:
        pager.wrap(m, pool=pool)
    pagers = [pager.of(m) for m in models]
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        for m, r in zip(models, refs):
            assert torch.equal(m(ids).logits, r(ids).logits)
    engine = pagers[0].engine
    assert sum(p.row_bytes for p in pagers) + engine.resident_bytes <= pool.engine.budget_bytes
    with pytest.raises(ValueError, match="caches"):
        pagers[0].set_budget(engine.least_budget() - 1)
    # (more models: at last no room for their experts, or for their blocks beside the others' caches)
    with pytest.raises(ValueError, match="need a cache of|held for life and in caches"):
        for _ in range(8):
            pager.wrap(_pair("mixtral")[1], pool=pool)
            assert engine.least_budget() <= pool.engine.budget_bytes


def test_a_host_budget_counts_the_blocks_paged_from_files_not_the_experts(tmp_path):
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_mixtral()).save_pretrained(tmp_path / "m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    layer = max(sum(p.numel() * p.element_size() for n, p in m.named_parameters() if "experts" not in n)
                for m in ref.model.layers)  # fmt: skip
    model = pager.from_pretrained(tmp_path / "m", budget=10 << 20, host_budget=8 * layer, device="cpu")
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_experts_fetched_ahead_on_the_gpu():
    """The copies ahead run on the cache's side stream; the calls that use
    them, and the misses copied into slots taken from them, wait for them."""
    ref, model = _pair("mixtral", "batched_mm")
    ref.cuda()
    pager.wrap(model, budget=16 << 20, device="cuda", expert_cache=_one_layer(model))
    ids = torch.randint(0, 64, (1, 4), device="cuda")
    kw = {"max_new_tokens": 24, "min_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    s = pager.of(model).stats()
    assert s.expert_ahead > 0 and s.expert_ahead_used > 0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_cache_of_one_tokens_experts_runs_a_prefill_by_chunks_of_tokens(kind, implementation):
    """A cache that holds only the experts of one token: a call routed to
    more runs by groups of tokens where the forward reads the cache in
    place (batched_mm), each token's output its own; the compact call
    (eager, and grouped_mm on the CPU device) copies the experts the cache
    lacks beyond its slots from the host, whole. Bit for bit either way."""
    ref, model = _pair(kind, implementation)
    token = 2 * _one_layer(model) // 8  # (2 of 8 experts routed)
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=token)
    assert pager.of(model).expert_tables[0].cache.capacity == 2
    ids = torch.randint(0, 64, (3, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    kw = {"max_new_tokens": 5, "min_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


def test_token_groups_hold_at_most_the_cache_and_gather_tokens_routed_alike():
    """[Note: groups of tokens]: each token in the first group that takes its
    experts within the cache, wherever it is in the call."""
    rows = [[0, 1], [1, 2], [2, 3], [0, 1], [0, 1], [4, 5]]
    assert token_groups(rows, 8, 2) == [[0, 3, 4], [1], [2], [5]]
    assert token_groups(rows, 8, 3) == [[0, 1, 3, 4], [2], [5]]
    assert token_groups(rows, 8, 6) == [[0, 1, 2, 3, 4, 5]]
    assert token_groups([], 8, 2) == [[]]
    assert token_groups([[0, 1]] * 5, 8, 8, most_tokens=2) == [[0, 1], [2, 3], [4]]
    assert token_groups([[3, 3]], 8, 1) == [[0]]  # (an expert named twice counts once)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_tokens_routed_alike_share_a_group_wherever_they_are(implementation):
    """Tokens whose routing alternates between two pairs of experts, a cache
    of two: two groups, each pair copied once (runs of consecutive tokens
    would copy a pair per token); each token's output its own."""
    ref, model = _pair("mixtral", implementation)
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=2 * _one_layer(model) // 8)
    table = pager.of(model).expert_tables[0]
    h, w = torch.randn(8, 32), torch.rand(8, 2)
    index = torch.tensor([[0, 1], [2, 3]] * 4)
    misses = pager.of(model).stats().expert_misses
    with torch.no_grad():
        got, want = table.module(h, index, w), _experts(ref)[0](h, index, w)
    assert pager.of(model).stats().expert_misses - misses == 4
    if implementation == "batched_mm":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_batched_mm_copies_of_a_long_call_stay_within_an_eighth_of_the_budget(monkeypatch):
    """`batched_mm` copies each token's k experts: a call of many tokens runs
    by groups of tokens whose copies fit an eighth of the budget, bit for bit."""
    ref, model = _pair("mixtral", "batched_mm")
    budget = 10 << 20
    pager.wrap(model, budget=budget, device="cpu")
    table = pager.of(model).expert_tables[0]
    per_token = 2 * table.expert_bytes
    most_tokens = budget // 8 // per_token
    forward, tokens = type(table.module).forward, []

    def counted(module, hidden, *args, **kwargs):
        if module is table.module:
            tokens.append(hidden.shape[0])
        return forward(module, hidden, *args, **kwargs)

    monkeypatch.setattr(type(table.module), "forward", counted)
    ids = torch.randint(0, 64, (2, most_tokens + 5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert tokens[0] == 0 and max(tokens[1:]) == most_tokens and sum(tokens) == ids.numel()


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def _moe_train(model, opt, steps):
    for step in range(steps):
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()


def _count_recipes(monkeypatch) -> list:
    """Saved views of experts' copies made again for a backward, counted."""
    from pager.experts import saved

    made, unpack = [], saved.unpack

    def counted(packed):
        made.append(isinstance(packed, saved.Recipe))
        return unpack(packed)

    monkeypatch.setattr(saved, "unpack", counted)
    return made


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_the_rest_of_a_mixture_trains_beside_frozen_paged_experts_bit_for_bit(kind, implementation, monkeypatch):
    """Gradients through frozen experts to their input ([Note: a backward
    through paged experts]): a cache smaller than two layers' experts, so
    that the slots a forward read are overwritten before the backward."""
    made = _count_recipes(monkeypatch)
    ref, model = _pair(kind, implementation)
    for m in (ref, model):
        for experts in _experts(m):
            experts.requires_grad_(False)
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model) * 3 // 2)
    opt, ref_opt = torch.optim.AdamW(_trainable(model), lr=1e-2), torch.optim.AdamW(_trainable(ref), lr=1e-2)
    _moe_train(model, opt, 3)
    _moe_train(ref, ref_opt, 3)
    s = pager.of(model).stats()
    assert s.expert_misses > 0 and (any(made) or implementation == "batched_mm")
    pager.unwrap(model)
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), n


def test_a_forward_with_gradients_keeps_no_copy_of_experts_for_its_backward(monkeypatch):
    """The copies a call with gradients made are freed at its end: its
    backward makes them again from the host (only the routed experts)."""
    import gc
    import weakref

    from pager.experts.saved import SavedExperts

    made = _count_recipes(monkeypatch)
    ref, model = _pair("mixtral", "grouped_mm")
    for m in (ref, model):
        for experts in _experts(m):
            experts.requires_grad_(False)
    pager.wrap(model, budget=10 << 20, device="cpu")
    copies, add = [], SavedExperts.add

    def recorded(self, values, experts):
        copies.extend(weakref.ref(v) for v in values)
        return add(self, values, experts)

    monkeypatch.setattr(SavedExperts, "add", recorded)
    ids = torch.randint(0, 64, (2, 12))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    gc.collect()
    assert copies and all(c() is None for c in copies)
    loss.backward()
    ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert any(made)  # (saved views of them made again from the host)
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), n


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_gradients_through_frozen_paged_experts_on_the_gpu(implementation):
    """On CUDA the backward's copies from the host run on the compute
    stream, before the kernels that read them."""
    ref, model = _pair("qwen3_moe", implementation)
    for m in (ref, model):
        for experts in _experts(m):
            experts.requires_grad_(False)
    ref.cuda()
    # (sized for the blocks: the reference model is on the same GPU, outside pager)
    pager.wrap(model, budget=16 << 20, device="cuda", expert_cache=_one_layer(model) * 3 // 2, budget_covers="pager")
    for step in range(2):
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step)).cuda()
        losses = [m(input_ids=ids, labels=ids, use_cache=False).loss for m in (model, ref)]
        torch.testing.assert_close(losses[0], losses[1])
        for loss in losses:
            loss.backward()
    grads = [(n, p.grad) for n, p in model.named_parameters() if p.requires_grad]
    assert pager.of(model).stats().expert_misses > 0
    for (n, g), r in zip(grads, [p for p in ref.parameters() if p.requires_grad]):
        torch.testing.assert_close(g.cpu(), r.grad.cpu(), rtol=1e-3, atol=1e-5, msg=n)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_what_a_call_with_gradients_saves_goes_to_the_hooks_beneath_or_is_a_recipe(implementation, monkeypatch):
    """Under the user's (or pager's activation policy's) saved-tensor hooks,
    every tensor the experts' forward saves reaches them, but the views of
    the experts' copies, kept as recipes of the experts they cover ([Note: a
    backward through paged experts])."""
    from pager.experts import saved

    recipes, unpack = [], saved.unpack

    def kept(packed):
        if isinstance(packed, saved.Recipe):
            recipes.append(packed)
        return unpack(packed)

    monkeypatch.setattr(saved, "unpack", kept)
    ref, model = _pair("mixtral", implementation)
    for m in (ref, model):
        for experts in _experts(m):
            experts.requires_grad_(False)
    pager.wrap(model, budget=10 << 20, device="cpu", activations="keep")
    h, index, w = torch.randn(5, 32), torch.tensor([[0, 1], [2, 3], [4, 5], [1, 2], [7, 0]]), torch.rand(5, 2)
    grads, counts = [], []
    for experts in (_experts(model)[0], _experts(ref)[0]):
        seen = []

        def pack(t, seen=seen):
            seen.append(t)
            return t

        x = h.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = experts(x, index, w)
        out.sum().backward()
        grads.append(x.grad)
        counts.append(len(seen))
    assert torch.equal(grads[0], grads[1])
    weights = 2 * len(index.unique()) if implementation == "eager" else 0  # (eager: two views of each routed expert)
    assert len(recipes) == weights or implementation == "grouped_mm"
    assert counts[0] + len(recipes) == counts[1] and counts[0] > 0
    if implementation == "eager":  # (a view of one expert makes that one again)
        assert all(len(r.experts) == 1 for r in recipes)


def test_experts_changed_between_forward_and_backward_are_an_error():
    ref, model = _pair("qwen3_moe", "eager")
    for experts in _experts(model):
        experts.requires_grad_(False)
    pager.wrap(model, budget=10 << 20, device="cpu")
    ids = torch.randint(0, 64, (2, 6))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    with torch.no_grad():
        _experts(model)[0].down_proj.add_(1.0)
    with pytest.raises(RuntimeError, match="paged experts' weights .* changed between the forward and the backward"):
        loss.backward()


def test_an_interrupt_inside_the_experts_forward_leaves_them_usable(monkeypatch, caplog):
    from pager.base import saving

    ref, model = _pair("mixtral", "grouped_mm")
    for m in (ref, model):
        for experts in _experts(m):
            experts.requires_grad_(False)
    pager.wrap(model, budget=10 << 20, device="cpu")
    table = pager.of(model).expert_tables[0]
    forward = type(table.module).forward

    def interrupted(module, *args, **kwargs):
        if module is table.module and not dry_running():  # (the call, not the measure before the forward)
            raise KeyboardInterrupt
        return forward(module, *args, **kwargs)

    monkeypatch.setattr(type(table.module), "forward", interrupted)
    ids = torch.randint(0, 64, (2, 6))
    with pytest.raises(KeyboardInterrupt):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    monkeypatch.undo()
    with caplog.at_level("WARNING", logger="pager"):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert "interrupted" in caplog.text and not table._calls
    loss.backward()
    ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert saving.depth() == 0 and saving.top_hooks() is None
    released = threading.Thread(target=lambda: table.cache.lock.acquire(timeout=5) and table.cache.lock.release())
    released.start(), released.join()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), n


def test_lora_on_attention_beside_paged_experts_trains_bit_for_bit(monkeypatch):
    peft = pytest.importorskip("peft")
    made = _count_recipes(monkeypatch)
    ref, model = _pair("qwen3_moe", "grouped_mm")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    ref = peft.get_peft_model(ref, lora)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, lora)
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model) * 3 // 2)
    assert pager.of(model).expert_tables
    opt, ref_opt = torch.optim.AdamW(_trainable(model), lr=1e-2), torch.optim.AdamW(_trainable(ref), lr=1e-2)
    _moe_train(model, opt, 3)
    _moe_train(ref, ref_opt, 3)
    assert any(made)
    pager.unwrap(model)
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), n


def test_a_cache_of_a_calls_experts_takes_none_ahead_and_keyword_calls():
    """A cache of one token's experts leaves no slot to fetch ahead into;
    a call by keywords only is as a call by position."""
    ref, model = _pair("mixtral", "batched_mm")
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=3 * _one_layer(model) // 8)  # (3 slots, k = 2)
    ids = torch.randint(0, 64, (1, 4))
    kw = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    experts, reference = _experts(model)[0], _experts(ref)[0]
    h, index, w = torch.randn(3, 32), torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.rand(3, 2)
    with torch.no_grad():
        got = experts(hidden_states=h, top_k_index=index, top_k_weights=w)
        assert torch.equal(got, reference(hidden_states=h, top_k_index=index, top_k_weights=w))
    a, b = h.detach().clone().requires_grad_(), h.detach().clone().requires_grad_()
    experts(hidden_states=a, top_k_index=index, top_k_weights=w).sum().backward()  # (trained, by chunks of tokens)
    reference(hidden_states=b, top_k_index=index, top_k_weights=w).sum().backward()
    assert torch.equal(a.grad, b.grad)
    for p, q in zip(experts.parameters(), reference.parameters()):
        assert torch.equal(p.grad + 0, q.grad)
    experts.requires_grad_(False), reference.requires_grad_(False)
    a, b = h.detach().clone().requires_grad_(), h.detach().clone().requires_grad_()
    experts(hidden_states=a, top_k_index=index, top_k_weights=w).sum().backward()
    reference(hidden_states=b, top_k_index=index, top_k_weights=w).sum().backward()
    assert torch.equal(a.grad, b.grad)


def test_a_chunk_that_fails_leaves_the_parameters_as_they_were(monkeypatch):
    ref, model = _pair("mixtral", "batched_mm")
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=2 * _one_layer(model) // 8)
    table = pager.of(model).expert_tables[0]
    forward, calls = type(table.module).forward, []

    def fails_second(*args, **kwargs):  # (its calls: the call of no tokens, then one a chunk)
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("out of memory in the second chunk")
        return forward(*args, **kwargs)

    monkeypatch.setattr(type(table.module), "forward", fails_second)
    h, index, w = torch.randn(3, 32), torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.rand(3, 2)
    with torch.no_grad(), pytest.raises(MemoryError):
        table.module(h, index, w)
    monkeypatch.undo()
    assert table.module.gate_up_proj.shape[0] == table.module.num_experts == 8
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), n


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_prefill_by_chunks_of_tokens_on_the_gpu(implementation):
    """A cache of one token's experts on the GPU: the call of no tokens runs
    on the cache's device tensors, then the chunks."""
    ref, model = _pair("mixtral", implementation)
    ref.cuda()
    pager.wrap(model, budget=16 << 20, device="cuda", expert_cache=2 * _one_layer(model) // 8)
    ids = torch.randint(0, 64, (3, 7), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)


def test_the_judge_counts_a_windows_copies_used_in_that_window_only(monkeypatch):
    monkeypatch.setattr(cache_module, "AHEAD_WINDOW", 4)
    cache = ExpertCache((((2,), torch.float32),), 16, torch.device("cpu"))
    taken = cache.take_ahead(0, [0, 1, 2, 3], protect=set())  # (a window: judged now, none used yet)
    assert len(taken) == 4 and cache.ahead_paused  # (none of them used: paused)
    cache.ahead_paused = 0
    cache.hold(0, [0, 1, 2, 3], lambda slot, key: None)  # (used after their window: credit to no window)
    assert cache.ahead_used == 4 and cache._window == [0, 0]
    cache.take_ahead(0, [4, 5], protect=set())
    cache.hold(0, [4], lambda slot, key: None)
    assert cache._window == [2, 1]


# ------------------------------------------------------------ experts trained
def _reached(model) -> list:
    """Per experts module, the experts the calls since the last clear routed to (filled by pre-hooks)."""
    found = [set() for _ in _experts(model)]

    def hook(i):
        def record(module, args, kwargs):
            index = kwargs.get("top_k_index", kwargs.get("router_indices", args[1] if len(args) > 1 else None))
            found[i].update(index.reshape(-1).tolist())

        return record

    for i, e in enumerate(_experts(model)):
        e.register_forward_pre_hook(hook(i), with_kwargs=True, prepend=True)
    return found


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_experts_train_one_by_one_bit_for_bit(kind, implementation):
    """The experts' own parameters train ([Note: experts trained one by
    one]): under SGD (whose update of an expert no token reached is none,
    so the update by expert is the dense one) equal to the unpaged model's
    bit for bit, with a cache smaller than two layers' experts."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    if implementation == "batched_mm":  # (torch's CPU index_put with accumulate adds in any order otherwise)
        torch.use_deterministic_algorithms(True)
    try:
        ref, model = _pair(kind, implementation)
        before = {n: p for n, p in model.named_parameters()}
        pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model) * 3 // 2)
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        start = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n}
        _moe_train(model, opt, 3)
        _moe_train(ref, ref_opt, 3)
        assert pager.of(model).stats().expert_misses > 0
        changed = [n for n, p in model.named_parameters() if n in start and not torch.equal(p.detach(), start[n])]
        assert changed and all(p is before[n] for n, p in model.named_parameters())
        pager.unwrap(model)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_call_with_gradients_copies_past_a_small_cache(implementation, frozen, monkeypatch):
    """With gradients, a call's routed experts come from the host into a
    copy of its own where they are trained ([Note: experts trained one by
    one]) or more than the cache holds (frozen: the rest of the model
    trains): a cache of one token's experts neither splits the call into
    groups of tokens nor takes them in, and the training is the unpaged
    one's bit for bit (SGD)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(implementation == "batched_mm" or deterministic)
    try:
        ref, model = _pair("mixtral", implementation)
        for m in (ref, model):
            for experts in _experts(m) if frozen else []:
                experts.requires_grad_(False)
        pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=2 * _one_layer(model) // 8)  # (2 slots, k = 2)
        table = pager.of(model).expert_tables[0]
        tokens, forward = [], type(table.module).forward

        def counted(module, hidden_states, *args, **kwargs):
            if module is table.module and not dry_running():
                tokens.append(hidden_states.shape[0])
            return forward(module, hidden_states, *args, **kwargs)

        monkeypatch.setattr(type(table.module), "forward", counted)
        opt, ref_opt = torch.optim.SGD(_trainable(model), lr=0.1), torch.optim.SGD(_trainable(ref), lr=0.1)
        _moe_train(model, opt, 2)
        _moe_train(ref, ref_opt, 2)
        monkeypatch.undo()
        assert tokens and all(n == 24 for n in tokens) and table.cache.held() == 0
        assert pager.of(model).stats().expert_misses > 0
        pager.unwrap(model)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), n


def _many_experts():  # a cache of more experts than a call's copies may hold at once
    return transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=128, num_experts_per_tok=2,
        max_position_embeddings=64,
    )  # fmt: skip


def _many_pair(implementation):
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_many_experts())
    model = transformers.AutoModelForCausalLM.from_config(_many_experts())
    model.load_state_dict(ref.state_dict())
    for m in (ref, model):
        m.set_experts_implementation(implementation)
    return ref, model


@pytest.mark.parametrize("budget", [300_000, 500_000])
def test_a_training_step_takes_room_from_the_experts_cache_within_the_budget(budget):
    """The cache wrap sized (the budget beyond the blocks' weights) gives a
    training step the room its blocks' gradients, the activations and the
    experts' copies need: from the first step, blocks and activations (the
    ledger's peak), the caches and the copies' share stay within the
    budget; the values are the unpaged model's bit for bit (SGD: the dense
    update)."""
    from pager.model import step_needs

    ref, model = _many_pair("batched_mm")
    pager.wrap(model, budget=budget, device="cpu")
    pg = pager.of(model)
    at_wrap = pg.row_bytes
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        pg.reset()
        ids = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
        held = pg.stats().peak_device_bytes + pg.row_bytes + step_needs.beside_bytes(pg)
        assert held <= budget - pg.outside_bytes, step
    caches = {id(t.cache): t.cache for t in pg.expert_tables}.values()
    assert pg.row_bytes == sum(c.device_bytes() for c in caches) < at_wrap
    assert pg.stats().expert_misses > 0
    pager.unwrap(model)
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), n


def test_a_step_the_forward_of_which_cannot_be_measured_is_refused_below_the_blocks_least():
    """Under `eager` (it reads the routing's values) the forward is not
    measured on fake tensors; a budget the blocks alone, with their
    gradients and what pager keeps beside them, do not fit is still refused
    before the forward runs, naming a budget that does."""
    ref, model = _many_pair("eager")
    pager.wrap(model, budget=90_000, device="cpu")
    ids = torch.randint(0, 64, (1, 4))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(pager.BudgetError, match="could not be measured") as refused:
        model(input_ids=ids, labels=ids).loss.backward()
    assert refused.value.least_budget_bytes > 90_000
    assert all(p.grad is None and torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    pager.unwrap(model)
    pager.wrap(model, budget=refused.value.least_budget_bytes, device="cpu")
    model(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a.grad + 0, b.grad), n


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_experts_of_a_folder_train_bit_for_bit(tmp_path, kind):
    """`pager.from_pretrained` of a `save_pretrained` folder (per-expert
    tensors fused by transformers' conversion, into host tables): the
    experts train there as wrapped ones do."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).save_pretrained(tmp_path, max_shard_size="40KB")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).train()
    model = pager.from_pretrained(tmp_path, budget=10 << 20, device="cpu", expert_cache=_one_layer(ref)).train()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    _moe_train(model, opt, 3)
    _moe_train(ref, ref_opt, 3)
    assert pager.of(model).stats().experts_stepped > 0
    pager.unwrap(model)
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), n


def test_an_expert_no_token_reached_is_neither_copied_nor_stepped(monkeypatch):
    """AdamW by expert is the lazy variant: an expert no token of a step
    reached keeps its weights and state rows; the others' are the dense
    update's bit for bit (the unpaged model, each step's unreached rows put
    back after its step). Steps reaching few experts update a view of their
    rows, those reaching most the whole tensors: both run."""
    from pager.experts import step as experts_step

    whole, step_whole = [], experts_step._step_whole

    def counted(param, rows, *args):
        whole.append(len(rows) < param.shape[0])
        return step_whole(param, rows, *args)

    monkeypatch.setattr(experts_step, "_step_whole", counted)
    ref, model = _pair("mixtral", "grouped_mm")
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model) * 3 // 2)
    reached = _reached(model)
    ref_experts = _experts(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    skipped = 0
    for step in range(4):
        ids = torch.randint(0, 64, (1, (12, 1, 3, 1)[step]), generator=torch.Generator().manual_seed(step))
        for found in reached:
            found.clear()
        misses = pager.of(model).stats().expert_misses
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        copied = pager.of(model).stats().expert_misses - misses
        assert copied <= 2 * sum(map(len, reached))  # (the forward's misses, and the backward's copies at most as many)
        ref(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        kept = []
        for e, found in zip(ref_experts, reached):
            rows = [x for x in range(e.num_experts) if x not in found]
            skipped += len(rows)
            for p in (e.gate_up_proj, e.down_proj):
                state = ref_opt.state.get(p, {})
                rows_of_state = {k: v[rows].clone() for k, v in state.items() if v.dim()}
                kept.append((p, rows, p.detach()[rows].clone(), rows_of_state))
        opt.step()
        ref_opt.step()
        with torch.no_grad():
            for p, rows, values, state in kept:
                p[rows] = values
                for k, v in state.items():
                    ref_opt.state[p][k][rows] = v
        opt.zero_grad()
        ref_opt.zero_grad()
    assert skipped > 0 and any(whole) and len(whole) < 4 * len(reached) * 2  # (some of each kind)
    for e, r in zip(_experts(model), ref_experts):
        for name in ("gate_up_proj", "down_proj"):
            p, q = getattr(e, name), getattr(r, name)
            assert torch.equal(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"]), name
            assert torch.equal(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"]), name
    pager.unwrap(model)
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), n


def test_trained_experts_gradients_clip_accumulate_save_and_unwrap():
    """What a training loop does with the experts' gradients and state
    (Adagrad: its update of an expert no token reached is none, so the
    update by expert is the dense one, and its state is made at its
    construction): two micro-batches, a read of `.grad` (the dense gradient, bit for bit),
    torch's clip (its norm within rounding of the dense gradient's), the
    optimizer's state_dict saved and loaded, and unwrap giving back the
    gradient and the state on the original device."""
    ref, model = _pair("qwen3_moe", "eager")
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model))
    experts, ref_experts = _experts(model)[0], _experts(ref)[0]
    opt = torch.optim.Adagrad(model.parameters(), lr=1e-2, foreach=True)  # (zero_grad then zeroes by foreach)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=1e-2, foreach=True)
    norms = []
    for step in range(3):
        for m in (model, ref):
            for micro in range(2):
                ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(10 * step + micro))
                m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                if step == 0 and micro == 0 and m is model:
                    assert type(experts.down_proj.grad).__name__ == "ExpertGrad"
                    _ = experts.down_proj.grad + 0  # (read by torch: the dense gradient, which becomes .grad ...)
                    assert type(experts.down_proj.grad) is torch.Tensor
        if step == 0:  # (... and the next micro-batch's gradient is added to it)
            assert torch.equal(experts.down_proj.grad, ref_experts.down_proj.grad)
        norms.append([torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5) for m in (model, ref)])
        opt.step()
        ref_opt.step()
        if step < 2:
            opt.zero_grad(set_to_none=step == 0)  # (then zeroed in place, the pieces emptied: no dense gradient made)
            ref_opt.zero_grad(set_to_none=step == 0)
            if step == 1:
                assert type(experts.gate_up_proj.grad).__name__ == "ExpertGrad"
    for paged, unpaged in norms:
        torch.testing.assert_close(paged, unpaged, rtol=1e-5, atol=0)
    opt.load_state_dict(opt.state_dict())
    pager.unwrap(model)
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
        assert a.grad is not None and a.grad.device == a.device and type(a.grad) is torch.Tensor, n
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=n)
    state = opt.state[experts.gate_up_proj]
    assert state["sum"].shape == experts.gate_up_proj.shape and type(state["sum"]) is torch.Tensor
    torch.testing.assert_close(state["sum"], ref_opt.state[ref_experts.gate_up_proj]["sum"], rtol=1e-4, atol=1e-9)


def test_micro_batches_hold_at_most_the_dense_gradient_on_the_host():
    """Gradient pieces are summed as they land: eight micro-batches hold
    the dense gradient and at most one piece beside it, and sum to the
    unpaged gradient bit for bit."""
    ref, model = _pair("mixtral", "eager")
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model) * 3 // 2)
    experts = _experts(model)[0]
    dense = experts.gate_up_proj.numel() * experts.gate_up_proj.element_size()
    for micro in range(8):
        ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(micro))
        for m in (model, ref):
            m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        g = experts.gate_up_proj.grad
        held = sum(piece.numel() * piece.element_size() for _e, piece, _ev in g.pending)
        held += 0 if g.summed_host is None else dense
        assert held <= 2 * dense, micro
    for e, r in zip(_experts(model), _experts(ref)):
        assert torch.equal(e.gate_up_proj.grad + 0, r.gate_up_proj.grad)


def test_reading_the_gradient_changes_no_update():
    """A read of `.grad` (logging) makes it dense, and it remembers the
    experts reached: the step updates those alone, as without the read."""
    got = []
    for read in (False, True):
        _ref, model = _pair("mixtral", "eager")
        pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model) * 3 // 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            ids = torch.randint(0, 64, (1, 2), generator=torch.Generator().manual_seed(step))  # (few experts)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            if read:
                for e in _experts(model):
                    assert e.down_proj.grad.abs().max() >= 0
            opt.step()
            opt.zero_grad(set_to_none=step != 1)
        pager.unwrap(model)
        got.append(model.state_dict())
    for (n, a), b in zip(got[0].items(), got[1].values()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("name", ["AdamW", "SGD", "Adagrad"])
def test_the_host_update_under_cuda_takes_the_fused_kernel_and_gives_the_options_back(name):
    """`fused_on_host` (the experts' update on the host under a CUDA device):
    torch's fused CPU kernel, the same update within rounding, the group's
    options as they were after; a class without one runs as it was made."""
    from pager.experts.step import fused_on_host

    torch.manual_seed(0)
    start = torch.randn(64, 8)
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    grads = [torch.randn(64, 8) for _ in range(3)]
    opts = [getattr(torch.optim, name)([p], lr=1e-2, foreach=True) for p in params]
    for g in grads:
        for p, opt, fused in zip(params, opts, (False, True)):
            p.grad = g.clone()
            with fused_on_host(opt, 0) if fused else contextlib.nullcontext():
                if fused:
                    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is False
                opt.step()
    assert opts[1].param_groups[0]["foreach"] is True and not opts[1].param_groups[0]["fused"]
    torch.testing.assert_close(params[0], params[1], rtol=1e-5, atol=1e-6)
    rms = torch.optim.RMSprop([params[0]], lr=1e-2, foreach=True)
    before = dict(rms.param_groups[0])
    with fused_on_host(rms, 0):
        assert rms.param_groups[0] == before


def test_state_kept_by_expert_in_other_shapes_and_a_hook_refused():
    """An optimizer whose state is by expert but not of the parameter's
    shape (torch's Adafactor: a row and a column factor per expert) keeps it
    by expert; a gradient hook on a trained experts parameter is refused
    before the call changes anything, and the model runs once it is gone."""
    _ref, model = _pair("mixtral", "eager")
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model) * 3 // 2)
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    for step in range(3):
        ids = torch.randint(0, 64, (1, 2 if step else 12), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    for e in _experts(model):
        state = opt.state[e.gate_up_proj]
        assert state["row_var"].shape[0] == state["col_var"].shape[0] == e.num_experts
    experts = _experts(model)[0]
    handle = experts.down_proj.register_hook(lambda g: g)
    ids = torch.randint(0, 64, (1, 4))
    with pytest.raises(RuntimeError, match=r"down_proj has a gradient hook .* experts=None"):
        model(input_ids=ids, labels=ids, use_cache=False)
    assert experts._parameters["down_proj"] is experts.down_proj
    handle.remove()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_experts_train_one_by_one_on_the_gpu(implementation):
    """On CUDA the gradients' pieces come to the host after the kernels that
    made them, and the update waits for every copy that reads the host."""
    ref, model = _pair("qwen3_moe", implementation)
    ref.cuda()
    # (sized for the blocks: the reference model is on the same GPU, outside pager)
    pager.wrap(model, budget=10 << 20, expert_cache=_one_layer(model) * 3 // 2, budget_covers="pager")
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(step)).cuda()
        for m, o in ((model, opt), (ref, ref_opt)):
            m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
            o.zero_grad()
    assert pager.of(model).stats().expert_misses > 0
    pager.unwrap(model)
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=2e-3, atol=2e-4, msg=n)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_cold_experts_computed_on_the_host_equal_the_model_and_are_not_copied(kind, implementation):
    """`cold_experts="host"`: a decode call's experts the cache lacks run on
    the host from their pages ([Note: cold experts on the host]): nothing
    of them crosses to the device, and the outputs equal the unpaged
    model's within rounding (a token's experts summed in another order)."""
    ref, model = _pair(kind, implementation)
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model), cold_experts="host")
    p, ids = pager.of(model), torch.randint(0, 64, (3, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)
        before = p.stats()
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    after = p.stats()
    assert torch.equal(out, ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0))
    # (the prompt's experts of more than a few tokens copied in; every decode call's cold experts on the host)
    assert after.expert_host - before.expert_host >= 7 * len(p.expert_tables)
    decode = model.generate(out, max_new_tokens=1, do_sample=False, pad_token_id=0)  # (warm: its prompt)
    moved = p.stats().expert_misses
    with torch.no_grad():
        for _ in range(3):
            model(decode[:, -1:])  # (3 tokens a call, at most 2 experts each: the host's)
    assert p.stats().expert_misses == moved and p.stats().expert_host > after.expert_host
    assert "computed on the host" in str(p.stats())
    pager.unwrap(model)
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), n


def test_cold_experts_auto_splits_them_by_measured_cost():
    from pager.experts.host import HOST_MOST_TOKENS, ColdExperts

    assert not ColdExperts("auto", cuda=False).on  # (the CPU device: the host is the device)
    cold = ColdExperts("auto", cuda=True)
    assert cold.on and cold.choose([1, 2, 3, 4], [1, 1, 1, 1], [1, 1, 1, 1]) == []  # (the link not timed yet)
    cold.link_seconds = 1.0
    assert cold.choose([1, 2, 3, 4], [5, 0, 9, 3], [1, 1, 1, 1]) == [2]  # (the host not timed: one, the least used)
    cold.host_took(9.0, 1)  # (in the host's first call: a warm-up, not counted)
    cold.host_call_done(5.0)
    assert cold.host_seconds == {} and cold.overhead_seconds == 0.0
    assert cold.choose([1, 2, 3, 4], [5, 0, 9, 3], [1, 1, 1, 1]) == [2]
    cold.host_took(1.0, 1)
    cold.host_call_done(0.0)
    # (the host's spare time not measured yet: none)
    assert cold.wait_seconds == {} and cold.choose([1, 2, 3, 4], [5, 0, 9, 3], [1, 1, 1, 1]) == []
    cold.wait_seconds = {4: 4.0}  # (after four cold experts copied, the host waited as long as the copies)
    assert cold.choose([1, 2, 3, 4], [5, 0, 9, 3], [1, 1, 1, 1]) == [2, 4]  # (as fast: half, the least used)
    big = HOST_MOST_TOKENS + 1
    assert cold.choose([1, 2, 3, 4], [5, 0, 9, 3], [big, big, 1, big]) == [3]  # (never a prefill's expert)
    assert cold.choose([1, 2, 3], [0, 0, 0], [2, 1, 1]) == [1]  # (two tokens: not timed yet, measured)
    cold.host_took(3.0, 2)  # (a product of two rows: its own mean)
    assert cold.host_seconds == {1: 1.0, 2: 3.0}
    assert cold.choose([1, 2, 3, 4], [0, 0, 0, 0], [2, 1, 2, 2]) == [2]  # (the cheaper; the other would end later)
    cold.host_seconds = {1: 1.0}
    assert cold.choose([7], [0], [1]) == []  # (a lone cold expert as slow on the host as over the link: copied)
    cold.host_seconds = {1: 0.5}
    assert cold.choose([7], [0], [1]) == [7]  # (faster on the host: computed there)
    cold.overhead_seconds = 0.6
    assert cold.choose([7], [0], [1]) == []  # (but not with the call's own cost on the host)
    cold.overhead_seconds, cold.wait_seconds = 0.0, {1: 0.4, 4: 0.0}
    assert cold.choose([7], [0], [1]) == []  # (nor where the host's queuing outlasts the device's work)
    assert cold.choose([1, 2, 3, 4], [0, 0, 0, 0], [1, 1, 1, 1]) == []  # (measured at 4: no wait, the host slower)
    # (at 3, not measured: no longer than at 4; none to the host)
    assert cold.choose([1, 2, 3], [0, 0, 0], [1, 1, 1]) == []
    cold.wait_seconds = {1: 0.4}  # (at 3: at least the 0.4 s at 1, at most two copies more; 0.4 s: none)
    assert cold._wait_for(3, 1.0) == 0.4 and cold.choose([1, 2, 3], [0, 0, 0], [1, 1, 1]) == []
    cold.wait_seconds = {6: 4.0}  # (at 3: at least 4.0 less three copies, at most 4.0: 1.0 s; one to the host)
    assert cold._wait_for(3, 1.0) == 1.0 and cold.choose([1, 2, 3], [0, 0, 0], [1, 1, 1]) == [1]
    assert ColdExperts("host", cuda=True).choose([1, 2], [0, 0], [1, big]) == [1]
    assert ColdExperts("device", cuda=True).on is False


def test_cold_experts_auto_measures_the_hosts_spare_time_and_remeasures_less_often():
    from pager.experts.host import REMEASURE_CALLS, WAIT_WEIGHT, ColdExperts

    cold = ColdExperts("auto", cuda=True)
    cold.link_seconds = 1.0
    cold.host_seconds = {1: 100.0}  # (far slower on the host than over the link)
    index = torch.tensor([[3, 5]])
    assert torch.equal(cold.routing_of(index, base=0), torch.tensor([3, 5]))  # (CPU tensors: nothing waited)
    assert cold.choose([3, 5], [0, 0], [1, 1], base=8) == []  # (a call of the table at 8: both copied)
    cold.routing_waited(0.5, base=0)  # (the next call, of the first layer: the token after; not a measure)
    assert cold.wait_seconds == {}
    assert cold.choose([3, 5], [0, 0], [1, 1], base=8) == []
    cold.routing_waited(0.5, base=16)  # (the next layer's routing: waited 0.5 s after 2 cold experts copied)
    assert cold.wait_seconds == {2: 0.5}
    cold.routing_waited(0.7, base=24)  # (its call was not all copied: not a measure)
    assert cold.wait_seconds == {2: 0.5}
    assert cold.choose([3, 5], [0, 0], [1, 1], base=8) == []
    cold.routing_waited(2.5, base=16)
    assert cold.wait_seconds == {2: pytest.approx(0.5 * (1 - WAIT_WEIGHT) + 2.5 * WAIT_WEIGHT)}
    # Measured again after REMEASURE_CALLS calls without the host, then twice as many while it still
    # takes none, each measure over two calls in a row: the first not counted
    gaps = []
    for _ in range(3):
        calls = 0
        while not cold.choose([3, 5], [0, 1], [1, 1]):
            calls += 1
        gaps.append(calls + 1)
        cold.host_took(1.0, 1)  # (a first call after a while: not counted)
        cold.host_call_done(1.0)
        assert cold.host_seconds == {1: 100.0} and cold.overhead_seconds == 0.0
        assert cold.choose([3, 5], [0, 1], [1, 1]) == [3]  # (the second, at once)
        cold.host_took(100.0, 1)
        cold.host_call_done(0.0)
    assert gaps == [REMEASURE_CALLS - 3, 2 * REMEASURE_CALLS, 4 * REMEASURE_CALLS]  # (3 calls above counted)
    # While the host takes some, one call in REMEASURE_CALLS is all copied: its wait measured again
    cold.host_seconds, cold.wait_seconds = {1: 0.1}, {2: 2.0}
    calls = [cold.choose([3, 5], [0, 1], [1, 1], base=8) for _ in range(REMEASURE_CALLS + 2)]
    assert calls[:REMEASURE_CALLS] == [[3, 5]] * REMEASURE_CALLS
    assert calls[REMEASURE_CALLS] == [] and calls[REMEASURE_CALLS + 1] == [3, 5]
    cold.host_seconds = {1: 100.0}
    calls = 0
    while not cold.choose([3, 5], [0, 1], [1, 1]):
        calls += 1
    assert calls + 1 == REMEASURE_CALLS  # (the interval back at its first: the host was taking some)


def test_the_links_time_is_read_from_events_made_once_and_never_waited_for(monkeypatch):
    from pager.experts.host import ColdExperts

    made = []

    class Event:  # (CUDA's, scripted: done once queried twice)
        def __init__(self, enable_timing=False):
            made.append(self)
            self.queries = 0

        def record(self, stream=None):
            self.queries = 0

        def query(self):
            self.queries += 1
            return self.queries > 1

        def elapsed_time(self, end):
            return 8.0  # ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    cold = ColdExperts("auto", cuda=True)
    for _ in range(3):
        start = cold.fills_start(None)
        cold.fills_end(start, None, 2)  # (two experts filled)
        assert cold.fills_start(None) is None  # (one timing at a time)
        cold.read_fills()  # (not done yet: not waited for)
        cold.read_fills()
    assert cold.link_seconds == pytest.approx(0.004) and len(made) == 2
    assert ColdExperts("host", cuda=True).fills_start(None) is None  # (timed under "auto" only)


def test_a_wrong_cold_experts_is_refused_unchanged():
    _ref, model = _pair("mixtral")
    before = {n: (p, p.device) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"cold_experts='cpu' must be \"auto\" .*\"host\" .*\"device\""):
        pager.wrap(model, budget=10 << 20, device="cpu", cold_experts="cpu")
    assert {n: (p, p.device) for n, p in model.named_parameters()} == before
    assert not _experts(model)[0]._forward_pre_hooks
    pager.wrap(model, budget=10 << 20, device="cpu", cold_experts="device")  # (and it can still be wrapped)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cold_experts", ["host", "auto"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_cold_experts_on_the_host_on_the_gpu(implementation, cold_experts):
    ref, model = _pair("mixtral", implementation)
    ref.cuda()
    pager.wrap(model, budget=16 << 20, device="cuda", expert_cache=_one_layer(model), cold_experts=cold_experts)
    ids = torch.randint(0, 64, (1, 7), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)
    out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0))
    cache = pager.of(model).expert_tables[0].cache
    if cold_experts == "host":
        assert pager.of(model).stats().expert_host > 0
    else:
        assert cache.cold.link_seconds is not None  # (a call's fills timed, read back at a later call)
        assert cache.cold.wait_seconds  # (the host's wait at the next layer's routing after a call all copied)
    pager.unwrap(model)


class _OwnExperts(torch.nn.Module):
    """Experts of one's own convention (fused tensors, the routing given),
    without transformers' flags: the host computes them by this forward;
    `out_dtype`: its output's (float32 for bfloat16 weights, say)."""

    def __init__(self, n=8, h=16, f=24, dtype=torch.float32, out_dtype=None):
        super().__init__()
        self.num_experts, self.out_dtype = n, out_dtype
        self.w_in = torch.nn.Parameter(torch.randn(n, f, h, dtype=dtype) * 0.2)
        self.w_out = torch.nn.Parameter(torch.randn(n, h, f, dtype=dtype) * 0.2)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros(hidden_states.shape, dtype=self.out_dtype or hidden_states.dtype)
        for t in range(hidden_states.shape[0]):
            for k in range(top_k_index.shape[1]):
                e = int(top_k_index[t, k])
                y = top_k_weights[t, k] * (self.w_out[e] @ torch.relu(self.w_in[e] @ hidden_states[t]))
                out[t] += y.to(out.dtype)
        return out


class _OwnMoE(torch.nn.Module):
    def __init__(self, h=16, dtype=torch.float32, out_dtype=None):
        super().__init__()
        self.gate = torch.nn.Linear(h, 8, dtype=dtype)
        self.experts = _OwnExperts(h=h, dtype=dtype, out_dtype=out_dtype)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, index = self.gate(flat).softmax(-1).topk(2)
        return x + self.experts(flat, index, weights).to(x.dtype).view_as(x)


@pytest.mark.parametrize("dtype, out_dtype", [(torch.float32, None), (torch.bfloat16, torch.float32)])
def test_cold_experts_of_a_module_of_ones_own_run_on_the_host_by_its_forward(dtype, out_dtype):
    """The host's products take the device output's dtype (a module that
    sums bfloat16 experts in float32), and where every expert of a call is
    the host's, the output is theirs alone."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[_OwnMoE(dtype=dtype, out_dtype=out_dtype) for _ in range(3)])
    model = torch.nn.Sequential(*[_OwnMoE(dtype=dtype, out_dtype=out_dtype) for _ in range(3)])
    model.load_state_dict(ref.state_dict())
    one = sum(p.numel() * p.element_size() for p in ref[0].experts.parameters())
    pager.wrap(model, budget=4 << 20, device="cpu", expert_cache=one, cold_experts="host")  # (a layer of 3)
    with torch.no_grad():
        for tokens in (3, 1, 1):  # (one token: both its experts cold in the layers after the first)
            x = torch.randn(tokens, 1, 16, dtype=dtype)
            torch.testing.assert_close(model(x), ref(x))
    assert pager.of(model).stats().expert_host > 0


def test_a_call_with_gradients_keeps_its_cold_experts_on_the_device():
    """Only calls without gradients split: a router trained beside frozen
    experts (its layer's input needs no gradient) gets every expert's term
    in its gradient, bit for bit."""
    ref, model = _pair("mixtral", "eager")
    for m in (ref, model):
        for n, p in m.named_parameters():
            p.requires_grad_(n == "model.layers.0.mlp.gate.weight")
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model) * 5 // 4, cold_experts="host")
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 60)))  # (a prefill: experts copied in)
    ids = torch.randint(0, 64, (1, 3))
    before = pager.of(model).stats().expert_host
    model(ids).logits.sum().backward()
    ref(ids).logits.sum().backward()
    assert pager.of(model).stats().expert_host == before
    gate = "model.layers.0.mlp.gate.weight"
    assert torch.equal(dict(model.named_parameters())[gate].grad, dict(ref.named_parameters())[gate].grad)


def test_an_interrupt_before_the_devices_forward_adds_nothing_of_the_hosts(monkeypatch):
    from pager.experts.table import ExpertTable

    _ref, model = _pair("mixtral", "eager")
    pager.wrap(model, budget=10 << 20, device="cpu", expert_cache=_one_layer(model) * 5 // 4, cold_experts="host")
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 60)))

    place = ExpertTable._place

    def interrupted(self, *args, **kwargs):
        if self._host is None:
            return place(self, *args, **kwargs)
        raise KeyboardInterrupt  # (Ctrl-C while the kept experts are copied in, the host's share taken)

    monkeypatch.setattr(ExpertTable, "_place", interrupted)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        for _ in range(8):
            model(torch.randint(0, 64, (1, 3)))
    monkeypatch.undo()
    table = pager.of(model).expert_tables[0]
    assert table._host is None and table.cache.lock.acquire(blocking=False)
    table.cache.lock.release()
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 3)))  # (usable after)
