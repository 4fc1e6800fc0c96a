"""Training a mixture's experts on one GPU, the experts paged one by one
([Note: experts trained one by one] in pager/experts/train.py).

A Qwen3-30B-A3B-shaped `Qwen3MoeForCausalLM` (bench_moe's shape: hidden 2048,
128 experts of MLP 768, 8 routed, bf16, random weights), `--layers` of its 48
layers, full fine-tuning with AdamW (bf16 parameters and state, foreach),
`--batch` sequences of `--seq` random tokens a step, the routing drawn
(bench_moe's `route`: `zipf` skewed, `uniform` every expert alike):

- all on the GPU: the same model, optimizer and steps;
- pager at each budget of `--budgets` (sizes, or `scaled`: 8 GiB for the
  full depth scaled to the slice as in bench_moe, too little to train the
  embedding and head with their AdamW state), the experts trained: each call
  copies its routed experts in, their gradients go to the host, and
  `opt.step()` updates the reached experts there with the same AdamW;
- pager at the same budget with the experts frozen (`requires_grad_(False)`:
  the rest of the model trains; what a LoRA-style fine-tune costs);
- with `--layers-row`, pager with `experts=None`: the experts paged and
  trained with their layers (every expert moves at every step), or the
  refusal where a layer with its state does not fit.

Per run: the step (median of the steps after the first two), the first step
(wrap included for pager), the allocator's peak, the experts a step reached
and the experts' bytes copied in a step; the losses of the first steps
beside all on the GPU's (the same tokens and routes: equal within bf16's
rounding while they agree).

    python -m benchmarks.bench_moe_train [--layers 2] [--budgets 4GiB,8GiB] [--routing zipf,uniform] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import pager
from benchmarks.bench_moe import config, cpu_model, route, scaled_budget
from benchmarks.harness import GiB, Row, environment, free_cuda, save


def _experts(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


def _steps(model, opt, batches: list, before=None) -> tuple[list, list]:
    """Seconds and loss of each step over `batches` (each ended by a sync)."""
    times, losses = [], []
    for i, ids in enumerate(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        if before is not None and i == 0:
            start = before
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # (a sync)
        times.append(time.perf_counter() - start)
    return times, losses


def _model(args, impl: str, device: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config("qwen3", args.layers), dtype=torch.bfloat16)
    model.set_experts_implementation(impl)
    return model.train()


def run(args, routing: str, impl: str) -> list:
    batches = [
        torch.randint(0, 151936, (args.batch, args.seq), generator=torch.Generator().manual_seed(s)).cuda()
        for s in range(args.steps)
    ]
    rows = []
    gpu = _model(args, impl, "cuda")
    host_state = {k: v.to("cpu") for k, v in gpu.state_dict().items()}  # (before it trains: pager's runs start here)
    buffers = {k: v.to("cpu") for k, v in gpu.named_buffers()}  # (non-persistent ones too: rotary's)
    hooks = route(gpu, routing)
    torch.manual_seed(1)  # (the routes drawn: the same in every run)
    opt = torch.optim.AdamW(gpu.parameters(), lr=1e-5, foreach=True)
    torch.cuda.reset_peak_memory_stats()
    times, ref_losses = _steps(gpu, opt, batches)
    ref_s = statistics.median(times[2:])
    workload = f"Qwen3-MoE-shaped, {args.layers} layers, {args.batch}x{args.seq} tokens, {routing} routing ({impl})"
    rows.append(
        Row(workload, "all on the GPU", ref_s * 1e3, torch.cuda.max_memory_allocated() / GiB, None, "",
            f"first step {times[0]:.2f} s; losses {' '.join(f'{x:.4f}' for x in ref_losses[:3])}",
            {"steps_s": times, "losses": ref_losses})
    )  # fmt: skip
    print(rows[-1], flush=True)
    for h in hooks:
        h.remove()
    budget_of = {"scaled": scaled_budget(gpu, "qwen3", args.layers)}
    del gpu, opt
    free_cuda()
    for label in args.budgets.split(","):
        budget = budget_of.get(label) or label
        for how in ("trained", "frozen", *(("with their layers",) if args.layers_row else ())):
            model = cpu_model(args, {k: v.clone() for k, v in host_state.items()}, buffers, impl).train()
            try:
                rows.append(_paged_row(model, routing, batches, budget, label, how, ref_s, ref_losses, workload))
            except pager.BudgetError as e:  # (experts with their layers: a layer and its state may not fit)
                rows.append(Row(workload, f"pager {label}, experts {how}", None, note=f"refused: {str(e)[:300]}"))
                pager.unwrap(model)
            print(rows[-1], flush=True)
            del model
            free_cuda()
    return rows


def _paged_row(model, routing, batches, budget, label, how, ref_s, ref_losses, workload) -> Row:
    """pager at `budget`, the experts `how`: "trained" (one by one), "frozen",
    or "with their layers" (`experts=None`: paged and trained as part of
    their layers' blocks, every expert moving at every step)."""
    if how == "frozen":
        for e in _experts(model):
            e.requires_grad_(False)
    hooks = route(model, routing)
    torch.manual_seed(1)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    pager.wrap(model, budget=budget, **({"experts": None} if how == "with their layers" else {}))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=True)
    counters = pager.of(model).counters
    caches_at_wrap = pager.of(model).row_bytes  # (row and experts' caches, sized for inference: a step takes some)
    moved, down, stepped = [], [], []
    times, losses = [], []
    for i, ids in enumerate(batches):
        before = (
            counters.expert_h2d_bytes + counters.expert_saved_h2d_bytes,
            counters.expert_grad_d2h_bytes,
            counters.experts_stepped,
        )
        t, loss = _steps(model, opt, [ids], before=start if i == 0 else None)
        times += t
        losses += loss
        moved.append(counters.expert_h2d_bytes + counters.expert_saved_h2d_bytes - before[0])
        down.append(counters.expert_grad_d2h_bytes - before[1])
        stepped.append(counters.experts_stepped - before[2])
    s = statistics.median(times[2:])
    experts = sum(e.num_experts for e in _experts(model))
    note = (
        f"first step (wrap included) {times[0]:.2f} s; a step: experts copied in "
        f"{statistics.median(moved[2:]) / 1e9:.2f} GB (forward and backward), "
        f"gradients to the host "
        f"{statistics.median(down[2:]) / 1e9:.2f} GB, {statistics.median(stepped[2:]):.0f} of {experts} experts "
        f"stepped; caches (rows, experts) {caches_at_wrap / GiB:.2f} GiB at wrap, "
        f"{pager.of(model).row_bytes / GiB:.2f} "
        f"after; losses {' '.join(f'{x:.4f}' for x in losses[:3])} (all on the GPU "
        f"{' '.join(f'{x:.4f}' for x in ref_losses[:3])})"
    )
    what = f"experts {how}"
    row = Row(workload, f"pager {label}, {what}", s * 1e3, torch.cuda.max_memory_allocated() / GiB, s / ref_s,
              "all on the GPU", note,
              {"steps_s": times, "losses": losses, "moved": moved, "down": down, "stepped": stepped})  # fmt: skip
    for h in hooks:
        h.remove()
    pager.unwrap(model)
    del model, opt
    free_cuda()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--budgets", default="4GiB,8GiB")
    ap.add_argument("--routing", default="zipf,uniform")
    ap.add_argument("--implementations", default="grouped_mm")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers-row", action="store_true", help="also pager with experts=None (paged with their layers)")
    args = ap.parse_args(argv)
    args.shape = "qwen3"  # (bench_moe's `cpu_model` reads it)
    env = environment()
    print(env, flush=True)
    rows = []
    for routing in args.routing.split(","):
        for impl in args.implementations.split(","):
            rows += run(args, routing, impl)
    save(rows, "bench_moe_train", env)


if __name__ == "__main__":
    main()
