"""Fine-tuning LoRA adapters on a model larger than the budget.

A 7B-shaped and a 13B-shaped Hugging Face Llama (bf16, `--layers` of their
layers), LoRA r=16 on q/k/v/o through peft, AdamW on the adapters, 4x512
tokens a step: all on the GPU (where it fits), pager under `--budget` with
the frozen pages plain and int4 ([Note: frozen pages], [Note: adapters stay
on the device]; defaults otherwise: the budget covers the process, the
activations, the head's logits and loss included; a refusal is reported
with the least budget it names), and
DeepSpeed ZeRO-3 with its parameters offloaded to the CPU on the same
adapters (skipped, and said so, where it is not installed; run after every
other row, for it changes torch's `F.linear` in the process). Each step's
floor is the frozen bytes it must read, twice (forward and backward), at the
pinned host-to-device rate measured in the same run.

    python -m benchmarks.bench_lora [--shapes 7b 13b] [--layers 16] [--budget 2 2.25] [--activations auto offload]
        [--reps 5] [--peers deepspeed]
"""

from __future__ import annotations

import argparse
import copy
import os

import torch

import pager
from benchmarks.bench_train import measure
from benchmarks.harness import GiB, Row, environment, free_cuda, host_rss_gib, pinned_h2d_gbps, save

SHAPES = {"7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32),
          "13b": dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40)}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def lora_llama(shape: str, layers: int, device: str):
    import peft
    import transformers

    dims = SHAPES[shape]
    # use_cache=False: training keeps no KV cache (1 GiB for 16 layers of these
    # shapes at 4x512 tokens, held until the loss is computed; Hugging Face's
    # gradient checkpointing turns it off, and so should every training loop).
    config = transformers.LlamaConfig(vocab_size=32000, num_hidden_layers=layers, use_cache=False,
                                      num_key_value_heads=dims["num_attention_heads"], **dims)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            base = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def make_step(model, opt, ids):
    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def bench_shape(shape, args, rows, gbps):
    w = f"{shape}-shaped Llama, {args.layers} layers bf16, LoRA r=16 q/k/v/o, AdamW, 4x512"
    ids = torch.randint(0, 32000, (4, 512), device="cuda")
    model = lora_llama(shape, args.layers, "cuda")
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    adapters = sum(p.numel() * p.element_size() for p in trainable(model))
    layers_frozen = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                        if ".layers." in n and not p.requires_grad)
    plain_floor_ms = 2 * layers_frozen / (gbps * 1e6)
    gpu_ms = None
    try:
        opt = torch.optim.AdamW(trainable(model), lr=1e-4)
        gpu_ms, peak = measure(make_step(model, opt, ids), args.reps)
        rows.append(Row(w, "all on GPU", gpu_ms, peak, 1.0, "itself",
                        f"frozen {frozen / GiB:.1f} GiB, adapters {adapters / 2**20:.0f} MiB"))
        print(rows[-1])
        # The usual LoRA setting: the model's own gradient checkpointing. What
        # its peak holds beyond the weights is the step's own working memory
        # (the head's logits and loss, a layer's temporaries), which pager's
        # budget does not bound either.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ms, peak = measure(make_step(model, opt, ids), args.reps)
        rows.append(Row(w, "all on GPU, gradient checkpointing", ms, peak, ms / gpu_ms, "all on GPU",
                        f"{peak - (frozen + adapters) / GiB:.2f} GiB beyond the weights"))
        model.gradient_checkpointing_disable()
        model.disable_input_require_grads()  # (which enabling it turned on for the adapters' sake)
        del opt
    except torch.OutOfMemoryError:
        rows.append(Row(w, "all on GPU", None, note="does not fit"))
    print(rows[-1])
    model = model.to("cpu")
    free_cuda()
    runs = [(b, a, c) for b in args.budget for a in args.activations for c in (None, "int4")]
    for budget_gib, activations, compress in runs:
        m = copy.deepcopy(model)
        budget = int(budget_gib * GiB)
        pager.wrap(m, budget=budget, device="cuda", compress=compress, activations=activations)
        pg = pager.of(m)
        opt = torch.optim.AdamW(trainable(m), lr=1e-4)
        method = f"pager {budget_gib:g} GiB" + (f", {compress} frozen pages" if compress else "")
        method += f", activations={activations!r}" if activations != "auto" else ""
        try:
            ms, peak = measure(make_step(m, opt, ids), args.reps, warmed=pg.reset)
        except pager.BudgetError as e:  # (a refusal is a result: the least budget it names)
            least = e.least_budget_bytes
            said = f"least budget {least / GiB:.2f} GiB" if least else str(e)[:160]
            rows.append(Row(w, method, None, note=f"refused: {said}"))
            print(rows[-1])
            pager.unwrap(m)
            del m, opt, pg
            free_cuda()
            continue
        s = pg.stats()
        steps = args.reps + 1  # (`measure` runs one step after `warmed` before timing)
        streamed = sum(seg.page_bytes for b in pg.blocks if not b.resident_for_life for seg in b.weight_segments)
        own_floor_ms = 2 * streamed / (gbps * 1e6)
        rows.append(Row(
            w, method, ms, peak,
            ms / plain_floor_ms, "plain floor",
            f"{ms / own_floor_ms:.2f}x its own floor ({2 * streamed / 1e9:.1f} GB); "
            + (f"{ms / gpu_ms:.2f}x all on GPU; " if gpu_ms else "")
            + f"per step {s.h2d_bytes / 1e9 / steps:.2f} GB in, {s.d2h_bytes / 1e6 / steps:.1f} MB out; "
            f"allocator peak {peak - budget_gib:+.2f} GiB vs the budget; pager's peak "
            f"{s.peak_device_bytes / GiB:.2f} GiB; stall {s.stall_seconds / steps * 1e3:.0f} ms/step; "
            f"activations {s.activations_policy} ({s.activations_sent_bytes / 1e9 / steps:.2f} GB sent, "
            f"{s.recomputes // steps} recomputations a step); "
            f"{sum(b.trainable for b in pg.blocks)} blocks trainable; host RSS {host_rss_gib():.1f} GiB",
            {"budget": budget, "h2d": s.h2d_bytes / steps, "d2h": s.d2h_bytes / steps, "floor_ms": plain_floor_ms,
             "own_floor_ms": own_floor_ms, "peak_device": s.peak_device_bytes},
        ))
        print(rows[-1])
        pager.unwrap(m)
        del m, opt, pg
        free_cuda()
    free_cuda()
    return lambda: peer_deepspeed(model, ids, w, plain_floor_ms, args.reps)


def peer_deepspeed(model, ids, w, floor_ms, reps):
    """ZeRO-3 with parameters offloaded to the CPU, the same adapters trained."""
    try:
        import deepspeed
    except ImportError as e:
        return Row(w, "DeepSpeed ZeRO-3 offload", None, note=f"skipped: not installed ({e.name})")
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533").items():
        os.environ.setdefault(k, v)
    try:
        m = copy.deepcopy(model)
        cfg = {"train_micro_batch_size_per_gpu": ids.shape[0], "bf16": {"enabled": True},
               "zero_force_ds_cpu_optimizer": False,
               "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}}
        engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.AdamW(trainable(m), lr=1e-4), config=cfg)

        def step():
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()

        ms, peak = measure(step, reps)
        return Row(w, "DeepSpeed ZeRO-3, parameters offloaded", ms, peak, ms / floor_ms, "plain floor")
    except Exception as e:  # noqa: BLE001 - a peer failing must not hide the rest
        return Row(w, "DeepSpeed ZeRO-3, parameters offloaded", None,
                   note=f"failed: {type(e).__name__}: {str(e)[:160]}")
    finally:
        free_cuda()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["7b", "13b"], choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--budget", type=float, nargs="+", default=[2.0], help="GiB (each in turn)")
    ap.add_argument("--activations", nargs="+", default=["auto"], help="activations= of wrap (each in turn)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--peers", default="deepspeed")
    args = ap.parse_args(argv)
    env = environment()
    gbps = pinned_h2d_gbps()
    env["pinned_h2d_GBps"] = round(gbps, 1)
    rows: list[Row] = []
    peers = [bench_shape(shape, args, rows, gbps) for shape in args.shapes]
    # DeepSpeed last: its ZeRO-3 replaces torch's F.linear for the whole
    # process (a version that saves every input, frozen weight or not).
    for peer in peers if "deepspeed" in args.peers else ():
        rows.append(peer())
        print(rows[-1])
    save(rows, "lora", env)


if __name__ == "__main__":
    main()
