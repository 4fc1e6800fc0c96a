"""Hugging Face checkpoint folders, as their users have them: saved with
`save_pretrained` (sharded or not), built on the meta device and paged
from the files by `pager.from_pretrained` or `pager.load` in one call."""

import copy
import json

import pytest
import torch

import pager

transformers = pytest.importorskip("transformers")


def _llama(num_hidden_layers=4, **kw):
    return transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=4,
                                    max_position_embeddings=64, **kw)


def _mistral():  # grouped KV heads
    return transformers.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _gpt2():  # tied embeddings, Conv1D
    return transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=4, n_head=4, n_positions=64)


def _gemma(cls):  # a scaled embedding whose `embed_scale` buffer no checkpoint holds, in a module with no config
    return lambda: cls(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


CONFIGS = {"llama": _llama, "mistral": _mistral, "gpt2": _gpt2,
           "llama-tied": lambda: _llama(tie_word_embeddings=True),
           "gemma": _gemma(transformers.GemmaConfig), "gemma2": _gemma(transformers.Gemma2Config)}


def _saved(tmp_path, kind: str, shard: str | None = "40KB", safe: bool = True):
    """A random model of `kind`, saved; returns the folder."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]())
    folder = tmp_path / kind
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, safe_serialization=safe, **kw)
    return folder


def _budget(model) -> int:
    """Room for the remainder and two of the four layers."""
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    layer = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - 2 * layer + 4096


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_folder_loads_in_one_call_and_generates_bit_for_bit(tmp_path, kind):
    folder = _saved(tmp_path, kind)
    if kind != "gpt2":
        assert (folder / "model.safetensors.index.json").exists()  # sharded
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    model = pager.from_pretrained(folder, budget=_budget(ref), device="cpu")
    assert not model.training and type(model) is type(ref)
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    s = pager.of(model).stats()
    assert s.evictions > 0  # paged, not all resident
    if kind in ("gpt2", "llama-tied"):
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_load_recreates_rotary_buffers_of_a_model_built_on_meta(tmp_path):
    """`from_config` under torch.device("meta") leaves the rotary
    embedding's non-persistent buffers on meta; load computes them again
    by building that module on the CPU, equal to transformers' own."""
    folder = _saved(tmp_path, "llama", shard=None)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_llama())
    assert model.model.rotary_emb.inv_freq.is_meta
    pager.load(model.eval(), folder, budget=_budget(ref), device="cpu")
    for name in ("inv_freq", "original_inv_freq"):
        assert torch.equal(getattr(model.model.rotary_emb, name), getattr(ref.model.rotary_emb, name))
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


class _Computed(torch.nn.Module):
    """A module whose non-persistent buffer is computed and which keeps no
    config to build it again from."""

    def __init__(self, n):
        super().__init__()
        self.lin = torch.nn.Linear(n, n)
        self.register_buffer("scale", torch.arange(n, dtype=torch.float32), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.scale


def test_a_buffer_that_cannot_be_made_again_is_refused_naming_it_before_anything_changes(tmp_path):
    torch.manual_seed(0)
    src = torch.nn.Sequential(_Computed(8), _Computed(8))
    path = tmp_path / "w.pt"
    torch.save(src.state_dict(), path)
    with torch.device("meta"):
        model = torch.nn.Sequential(_Computed(8), _Computed(8))
    with pytest.raises(ValueError, match=r"0\.scale \(_Computed: it keeps no `config`.*build those modules again"):
        pager.load(model, path, budget="1MiB", device="cpu")
    assert model[0].scale.is_meta and model[0].lin.weight.is_meta  # untouched
    with pytest.raises(ValueError, match="not wrapped"):
        pager.of(model)


def test_a_folder_with_a_torch_save_file_and_another_dtype(tmp_path):
    """A folder with `pytorch_model.bin` (older transformers' format, a
    `torch.save` state dict) loads too; a bf16 checkpoint builds a bf16
    model (the files' dtype)."""
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_llama(), dtype=torch.bfloat16).eval()
    folder = tmp_path / "bin"
    ref.config.architectures = ["LlamaForCausalLM"]  # (built by that class, in bf16)
    ref.config.save_pretrained(folder)
    torch.save(ref.state_dict(), folder / "pytorch_model.bin")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    model = pager.from_pretrained(folder, budget=_budget(ref), device="cpu")
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_a_folder_with_a_variant_beside_its_weights_reads_the_weights(tmp_path):
    """`save_pretrained(variant="fp16")` beside the weights: the weights are
    read, as from_pretrained reads them without variant=; the variant when its
    file is given. Checkpoints none of which save_pretrained names are refused,
    naming them, before the model is touched."""
    import safetensors.torch

    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_llama()).eval()
    folder = tmp_path / "variant"
    ref.save_pretrained(folder)
    half = {k: (v * 2).half() for k, v in ref.state_dict().items()}  # (other values: the test tells which is read)
    half.pop("lm_head.weight", None)
    safetensors.torch.save_file(half, str(folder / "model.fp16.safetensors"))
    ids = torch.randint(0, 128, (1, 5))
    model = pager.from_pretrained(folder, budget=_budget(ref), device="cpu")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    pager.unwrap(model)
    # (a variant in shards beside the weights: its index is not theirs)
    (folder / "model.fp16.safetensors").rename(folder / "model.fp16-00001-of-00001.safetensors")
    weight_map = {k: "model.fp16-00001-of-00001.safetensors" for k in half}
    (folder / "model.fp16.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = pager.from_pretrained(folder, budget=_budget(ref), device="cpu")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    pager.unwrap(model)
    (folder / "model.fp16.safetensors.index.json").unlink()
    (folder / "model.fp16-00001-of-00001.safetensors").rename(folder / "model.fp16.safetensors")
    (folder / "diffusion_pytorch_model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"the weights of two models \(model\.safetensors, diffusion_py"):
        pager.from_pretrained(folder, budget=_budget(ref), device="cpu")
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    (folder / "model.safetensors").rename(folder / "model.fp32.safetensors")
    with pytest.raises(FileNotFoundError, match=r"2 checkpoints \(model\.fp16\.safetensors, model\.fp32\.safe"):
        pager.from_pretrained(folder, budget=_budget(ref), device="cpu")
    meta = copy.deepcopy(ref).to("meta")
    with pytest.raises(FileNotFoundError, match="give the path of the one to read"):
        pager.load(meta, folder, budget=_budget(ref), device="cpu")
    assert meta.lm_head.weight.is_meta
    with pytest.raises(ValueError, match="not wrapped"):
        pager.of(meta)


def test_a_folder_that_is_not_a_checkpoint_is_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        pager.from_pretrained(tmp_path, budget="1MiB", device="cpu")


@pytest.mark.parametrize("tied,compress", [(False, None), (True, None), (False, "lossless")])
def test_large_embeddings_and_head_become_blocks_when_loaded_unasked(tmp_path, tied, compress):
    """A vocabulary whose embedding and head (2 MiB each) do not fit the
    budget beside a layer: loaded from files (not by rows: those are built
    from values in memory), they become blocks of their own; generate()
    equals transformers' own."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                      tie_word_embeddings=tied)
    src = transformers.AutoModelForCausalLM.from_config(config)
    folder = tmp_path / "big-vocab"
    src.save_pretrained(folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    table = 8192 * 64 * 4
    # (tied: one 2 MiB table, which with a layer of 164 KiB beside it does not fit)
    model = pager.from_pretrained(folder, budget=table + (100_000 if tied else 200_000), device="cpu",
                                  compress=compress)  # (lossless leaves fp32 pages plain: exact)
    names = pager.of(model).block_names()
    assert "model.embed_tokens" in names and "lm_head" in names
    ids = torch.randint(0, 8192, (2, 6))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


def test_load_pages_tables_by_rows_from_the_files_when_asked(tmp_path):
    """`pager.load(..., rows=[...])`: the table is read whole into host
    memory (its host table), the rest paged from the files; training the
    loaded model equals training the model loaded by transformers."""
    from test_rows import assert_same

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    src = transformers.AutoModelForCausalLM.from_config(config)
    folder = tmp_path / "rows"
    src.save_pretrained(folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    pager.load(model, folder, budget="4MiB", device="cpu", rows=["model.embed_tokens"])
    assert type(model.model.embed_tokens.weight).__name__ == "RowTableParameter"
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for i in range(3):
        ids = torch.randint(0, 4096, (2, 8), generator=torch.Generator().manual_seed(i))
        for m, o in zip((ref, model), opts):
            m(ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    assert_same(ref, model)


def _train_llamas(pairs, steps=3):
    """`steps` steps of each (model, optimizer) of `pairs` on the same batches."""
    for i in range(steps):
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(i))
        for m, o in pairs:
            m(ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("opt_name", ["adamw", "sgd_momentum"])
def test_plans_training_budget_trains_and_ten_percent_less_is_refused(opt_name):
    """Issue 40's case: a budget that runs inference (the remainder and three
    layers) is not one that trains; `plan(..., optimizer=)` gives the least
    budget that trains, and training under it equals the unwrapped model's."""
    from helpers import assert_models_equal

    torch.manual_seed(0)
    config = _llama(num_hidden_layers=6)
    ref = transformers.AutoModelForCausalLM.from_config(config)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(ref.state_dict())
    make = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
            "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)}[opt_name]
    ro, opt = make(ref.parameters()), make(model.parameters())
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long)}
    least = pager.plan(model, "1GiB", device="cpu", optimizer=opt, inputs=batch).train_min_budget_bytes
    short = pager.plan(model, int(0.9 * least), device="cpu", optimizer=opt, inputs=batch)
    assert short.runs and not short.trains and "WILL NOT TRAIN" in str(short)
    pager.wrap(model, budget=least, device="cpu", optimizer=opt)
    _train_llamas([(ref, ro), (model, opt)])
    assert_models_equal(model, ref)
    assert pager.of(model).stats().evictions > 0


def test_plans_training_budget_with_master_weights():
    """A bf16 Llama under master_weights keeps float32 state and a float32
    master a parameter: the plan's least budget that trains counts them
    (with bf16 state counted, training at it runs out of room), and training
    under it equals the hand-kept masters' loop."""
    torch.manual_seed(0)
    config = _llama(num_hidden_layers=6)
    import copy

    from helpers import assert_models_equal
    from test_masters import HandMasters

    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), HandMasters(ref, torch.optim.AdamW)
    plain = pager.plan(model, "1GiB", device="cpu", optimizer=opt).train_blocks_min_bytes
    blocks = pager.plan(model, "1GiB", device="cpu", optimizer=opt, master_weights=True).train_blocks_min_bytes
    assert blocks > 1.7 * plain
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long)}
    least = pager.plan(model, "1GiB", device="cpu", optimizer=opt, master_weights=True, inputs=batch)
    least = least.train_min_budget_bytes  # (with the activations of a step on this batch)
    pager.wrap(model, budget=least, device="cpu", optimizer=opt, master_weights=True)
    _train_llamas([(model, opt), (ref, ref_opt)])
    assert pager.of(model).stats().evictions > 0
    assert_models_equal(model, ref)  # (bit for bit the loop that keeps masters by hand)


def test_tqdms_monitor_thread_is_not_a_user_of_the_tensors():
    """Progress bars (transformers' save and load show them) leave tqdm's
    monitor thread running: it never reads a tensor, so a model stays out of
    the shared mode."""
    tqdm = pytest.importorskip("tqdm")
    from tqdm._monitor import TMonitor

    monitor = TMonitor(tqdm.tqdm, 10)  # (what tqdm starts with its first bar)
    try:
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        pager.wrap(model, budget=2 * 8 * 9 * 4 + 2048, device="cpu")
        with torch.no_grad():
            model(torch.randn(2, 8))
        assert not pager.of(model).shared_mode
    finally:
        monitor.exit()


@pytest.mark.parametrize("codec", ["lossless", "int4"])
def test_load_encodes_pages_as_it_reads_them(tmp_path, codec):
    """`pager.load(..., compress=)`: pages read from the files and encoded,
    equal to wrapping the loaded model with the same codec."""
    torch.manual_seed(0)
    config = _llama()
    src = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder = tmp_path / codec
    src.save_pretrained(folder, max_shard_size="40KB")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    budget = _budget(ref)
    pager.wrap(ref, budget=budget, device="cpu", compress=codec)
    model = pager.from_pretrained(folder, budget=budget, device="cpu", compress=codec)
    encoded = [b for b in pager.of(model).blocks if b.weights.encoded is not None]
    assert encoded and len(encoded) == sum(b.weights.encoded is not None for b in pager.of(ref).blocks)
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    with pytest.raises(ValueError, match="host_budget"):
        pager.from_pretrained(folder, budget=budget, device="cpu", compress=codec, host_budget="1MiB")


def test_the_hugging_face_trainer_trains_a_wrapped_model(tmp_path):
    """`transformers.Trainer` moves the model it is given (`model.to(device)`,
    to where it is) and runs its loop (clipping, a schedule, AdamW): on a
    wrapped model that streams, as on the unwrapped one, bit for bit."""
    pytest.importorskip("accelerate")
    from helpers import assert_models_equal

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama(num_hidden_layers=4))
    ref = copy.deepcopy(model)
    pager.wrap(model, budget=2 * sum(p.numel() * p.element_size() for p in model.parameters()), device="cpu")
    ids = torch.randint(0, 128, (8, 16))
    data = [{"input_ids": row, "labels": row} for row in ids]
    losses = []
    for m in (model, ref):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=2, num_train_epochs=2, learning_rate=1e-3,
            max_grad_norm=1.0, report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0)
        losses.append(transformers.Trainer(model=m, args=args, train_dataset=data).train().training_loss)
    assert pager.of(model).stats().evictions > 0
    assert losses[0] == losses[1]
    assert_models_equal(model, ref)
