"""Fine-tune LoRA adapters (peft) on a Hugging Face Llama larger than the budget.

The frozen weights stream through the budget read-only (never written back;
with --compress int4 they cross the link in a quarter of the bytes), the
adapters stay on the device with their gradients and AdamW state. On a GPU:
a 7B-shaped bf16 Llama (16 layers, 6.5 GB) under a 2 GiB budget. Without
one: a small fp32 Llama on the CPU device (host memory stands for device
memory), the same paging code, checked bit for bit against the unwrapped
model trained alongside.

    pip install transformers peft
    python examples/finetune_lora.py [--budget 2GiB] [--layers 16] [--compress int4] [--steps 5]

The file stands alone: after `pip install pager` it runs from any folder.
Without transformers or peft it says so and exits (status 0) without training.
`--layers 2 --steps 2` makes the CPU run quicker. The adapter is saved to
`$OUT/lora-adapter` (`./lora-adapter` without OUT).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import time

import torch

import pager

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # LoRA on the attention's projections


def build(cuda: bool, layers: int):
    """The peft model and its vocabulary size."""
    import peft
    import transformers

    if cuda:  # 7B-shaped, bf16, built on the GPU (fast random init), then handed over on the CPU
        dims = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_attention_heads=32)
        config = transformers.LlamaConfig(num_hidden_layers=layers, num_key_value_heads=32, use_cache=False, **dims)
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                base = transformers.LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(torch.float32)
        lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0)
        model = peft.get_peft_model(base, lora).to("cpu")
        torch.cuda.empty_cache()
        return model, config.vocab_size
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_attention_heads=4,
        num_hidden_layers=layers,
        use_cache=False,  # (training keeps no KV cache)
    )
    lora = peft.LoraConfig(
        r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False
    )  # (random B: the check sees updates)
    return peft.get_peft_model(transformers.LlamaForCausalLM(config), lora), config.vocab_size


def main():
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16 if cuda else 4)
    ap.add_argument("--budget", default="2GiB" if cuda else "60%-of-model")
    ap.add_argument(
        "--compress",
        choices=["lossless", "fp8", "int4"],
        default=None,
        help="the frozen weights compressed in their host pages, decoded on the device",
    )
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"skipped: this example needs transformers and peft: pip install transformers peft ({e})")
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model, vocab = build(cuda, args.layers)
    device = "cuda" if cuda else "cpu"
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    reference = None if cuda else copy.deepcopy(model)
    budget = int(0.6 * weights) if args.budget == "60%-of-model" else args.budget
    pager.wrap(model, budget=budget, device=device, compress=args.compress, activations="recompute")
    pg = pager.of(model)
    if reference is not None and args.compress in ("fp8", "int4"):
        reference.load_state_dict(model.state_dict())  # lossy: train against the weights as decoded
    adapters = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(adapters, lr=1e-4)
    print(
        f"model: {pager.format_bytes(weights)} of weights, {len(pg.blocks)} blocks; adapters "
        f"{pager.format_bytes(sum(p.numel() * p.element_size() for p in adapters))}; budget "
        f"{pager.format_bytes(pg.budget_bytes)} on {device}"
    )

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (4, 512) if cuda else (2, 32), generator=g) for _ in range(args.steps)]
    for i, ids in enumerate(batches):
        t0 = time.perf_counter()
        loss = model(input_ids=ids.to(device), labels=ids.to(device)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        print(f"step {i}: loss {loss.item():.4f}, {1e3 * (time.perf_counter() - t0):.0f} ms")
    print(pg.stats())

    if reference is not None:
        ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-4)
        for ids in batches:
            reference(input_ids=ids, labels=ids).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
        print(f"equal to the unwrapped model after {args.steps} steps, bit for bit: {same}")
        assert same
    model.save_pretrained(os.environ.get("OUT", ".") + "/lora-adapter")  # the adapter alone, as peft saves it
    pager.unwrap(model)


if __name__ == "__main__":
    main()
