"""Pager's host work per block use, counted in lines of its code (a count, not a time).

A LoRA step on a GPU host at a tight budget is bound by the host one step
and by the link the next (benchmarks/RESULTS.md, "LoRA at 2 GiB: the link
or the host"): timings there cannot show a change of a few percent of the
host's work. This counts, on the CPU device, the lines of pager's code that
a step runs (all threads, autograd's included), by file and by function,
and per block use: deterministic, so two trees compare exactly.

Models: `lora`, a Hugging Face Llama (16 layers 128 wide) with peft's LoRA
r=16 on q/k/v/o, its linears as blocks as pager splits a 7B-shaped layer
at 2 GiB, AdamW, `activations="recompute"` (as the 7B run chooses), under
`--share` of its bytes; `linear`, 256 `Linear(8, 8)` blocks in inference
under a quarter of them (test_engine's count).

    python -m benchmarks.host_lines [--model lora|linear] [--share 0.3] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading

import torch

import pager


def lora_model(share: float):
    """The LoRA Llama wrapped under `share` of its bytes, and its step."""
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        num_hidden_layers=16,
        use_cache=False,
        hidden_size=128,
        intermediate_size=352,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(config),
        peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    inner = model.base_model.model
    parts = [m for n, m in model.named_modules() if n.endswith(("base_layer", "gate_proj", "up_proj", "down_proj"))]
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    pager.wrap(
        model,
        budget=int(share * nbytes),
        device="cpu",
        activations="recompute",
        blocks=[*inner.model.layers, *parts, inner.model.embed_tokens, inner.lm_head],
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, 512, (1, 16))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return model, step


def linear_model(share: float):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(256)])
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    pager.wrap(model, budget=int(share * nbytes), device="cpu")
    x = torch.randn(2, 8)

    def step():
        with torch.no_grad():
            model(x)

    return model, step


def count(step, steps: int) -> collections.Counter:
    """Lines of pager's code that `steps` calls of `step` run, by (file, function)."""
    root = os.path.dirname(pager.__file__) + os.sep
    lines: collections.Counter = collections.Counter()

    def local(frame, event, _arg):
        if event == "line":
            lines[(frame.f_code.co_filename[len(root) :], frame.f_code.co_name)] += 1
        return local

    def calls(frame, _event, _arg):
        return local if frame.f_code.co_filename.startswith(root) else None

    sys.settrace(calls)
    threading.settrace(calls)  # (autograd's threads run the backward's hooks)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="lora", choices=["lora", "linear"])
    ap.add_argument("--share", type=float, default=None, help="budget as a share of the model's bytes")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=30, help="functions listed")
    args = ap.parse_args(argv)
    share = args.share if args.share is not None else (0.3 if args.model == "lora" else 0.25)
    model, step = (lora_model if args.model == "lora" else linear_model)(share)
    p = pager.of(model)
    for _ in range(4):  # the order learned, the policy chosen, state made
        step()
    p.reset()
    lines = count(step, args.steps)
    s = p.stats()
    uses = s.hits + s.misses
    total = sum(lines.values())
    print(
        f"{args.model} under {share:g} of its bytes: {total / args.steps:.0f} lines of pager a step, "
        f"{uses / args.steps:.0f} uses, {(s.prefetches + s.misses) / args.steps:.0f} fetches, "
        f"{s.evictions / args.steps:.0f} evictions a step: {total / max(uses, 1):.0f} lines a use"
    )
    files: collections.Counter = collections.Counter()
    for (path, _fn), n in lines.items():
        files[path] += n
    print("by file, a step:")
    for path, n in files.most_common(16):
        print(f"  {n / args.steps:9.0f}  {path}")
    print("by function, a step:")
    for (path, fn), n in lines.most_common(args.top):
        print(f"  {n / args.steps:9.0f}  {path}:{fn}")
    pager.unwrap(model)


if __name__ == "__main__":
    main()
