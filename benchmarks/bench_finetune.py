"""Full fine-tuning of a 7B-shaped bf16 model on one GPU, with float32 master
weights and AdamW state (ZeRO-Offload's headline case).

Layers of Llama-7B's shape (d=4096, ff=11008, 32 heads, vocab 32000), `--layers`
of them (24 by default: 5.1B parameters; bf16 weights and gradients, float32
masters and AdamW moments make 16 bytes a parameter, 82 GB, more than an 80 GB
GPU holds). bf16 compute, AdamW, 4x1024 tokens a step. Each system runs in a
process of its own, so the host holds one system's copy at a time.

- pager: `master_weights=True` at each of `--budgets` (GiB), the defaults
  otherwise (optimizer_step="auto", activations="auto").
- DeepSpeed ZeRO-Offload: stage 2, bf16, AdamW offloaded to the CPU (its CPU
  Adam over float32 masters and state); one process.
- torchao CPUOffloadOptimizer (fused CPU AdamW): it keeps the state in the
  parameters' dtype, so on the bf16 model ("torchao") its state is bf16 and it
  trains less precisely; with float32 state ("torchao32") the model is float32
  on the GPU, its forward under bf16 autocast, gradients offloaded as made.
- All on the GPU with plain AdamW (state in bf16): the compute floor, where it
  fits; not the same training either.

    python -m benchmarks.bench_finetune [--layers 24] [--budgets 16 32]
        [--systems pager,deepspeed,torchao,torchao32,gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict

import torch

from benchmarks.harness import GiB, Row, environment, free_cuda, host_rss_gib, save
from benchmarks.models import Decoder

VOCAB, BATCH, SEQ = 32000, 4, 1024
LR = 1e-5
SETTLE_STEPS = 8  # pager: steps after activations' trials while the host's share settles
WORKLOAD = "7B-shaped bf16 full fine-tune, AdamW, 4x1024"


def build(layers: int) -> Decoder:
    """The model in bf16 on the CPU, its weights drawn on the GPU (fast) and
    copied down."""
    with torch.device("meta"):
        model = Decoder(n_layers=layers, d=4096, ff=11008, heads=32, vocab=VOCAB)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    gen = torch.Generator("cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # (the norms)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.bfloat16).mul_(0.02))
    return model


def batch():
    gen = torch.Generator("cuda").manual_seed(1)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=gen),
            torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=gen))


def timed(step, reps: int, before: int = 2) -> tuple[float, float]:
    """(median ms of `reps` steps, allocator peak GiB over them), after `before` steps."""
    from benchmarks.harness import time_ms

    for _ in range(before):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = time_ms(step, warmup=1, reps=reps)
    return ms, torch.cuda.max_memory_allocated() / GiB


def plain_step(model, opt, ids, tgt):
    from benchmarks.bench_train import make_step

    return make_step(model, opt, ids, tgt)


def run_pager(layers: int, reps: int, budget_gib: float) -> Row:
    import pager
    from benchmarks.bench_train import AUTO_MAX_TRIAL_STEPS

    ids, tgt = batch()
    model = build(layers)
    pager.wrap(model, budget=int(budget_gib * GiB), device="cuda", master_weights=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    step = plain_step(model, opt, ids, tgt)
    pg = pager.of(model)
    step()  # (the first update of each block makes its masters and state, on the device)
    for _ in range(AUTO_MAX_TRIAL_STEPS):  # "auto" tries both activation policies first: not timed
        if pg.stats().activations_policy != "auto":
            break
        step()
    ms, peak = timed(step, reps, before=SETTLE_STEPS)
    pg.apply_deferred()  # (the updates on the host of the steps before done: the counts below are one step's)
    pg.reset()
    step()
    pg.apply_deferred()
    s = pg.stats()
    note = (f"per step {s.h2d_bytes / 1e9:.1f} GB in, {s.d2h_bytes / 1e9:.1f} GB out; {s.host_steps} updates on "
            f"the host ({1e3 * s.host_step_seconds:.0f} ms of the host's; {s.host_master_passes} masters in one "
            f"pass), waited for "
            f"{1e3 * s.host_step_wait_seconds:.0f} ms; activations {s.activations_policy}")
    return Row(WORKLOAD, f"pager, budget {budget_gib:g} GiB, master_weights", ms, peak, note=note,
               extra={"host_rss_gib": host_rss_gib()})


def run_deepspeed(layers: int, reps: int) -> Row:
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29531")):
        os.environ.setdefault(key, value)
    import deepspeed
    import torch.nn.functional as F

    ids, tgt = batch()
    model = build(layers)
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "overlap_comm": True, "contiguous_gradients": True},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step():
        loss = F.cross_entropy(engine(ids).flatten(0, 1), tgt.flatten())
        engine.backward(loss)
        engine.step()

    ms, peak = timed(step, reps)
    return Row(WORKLOAD, "DeepSpeed ZeRO-Offload (stage 2, CPU AdamW, float32 masters)", ms, peak,
               extra={"host_rss_gib": host_rss_gib()})


ON_GPU = {
    "torchao": "torchao CPUOffloadOptimizer (bf16 state)",
    "torchao32": "torchao CPUOffloadOptimizer, float32 model under bf16 autocast (float32 state)",
    "gpu": "all on GPU, AdamW (bf16 state, no masters)",
}


def run_on_gpu(system: str, layers: int, reps: int) -> Row:
    """The whole model on the GPU (`ON_GPU`): torchao on the bf16 model; torchao
    with float32 state (the model in float32, its forward under bf16
    autocast, gradients offloaded as they are made); or plain fused AdamW."""
    ids, tgt = batch()
    model = (build(layers).float() if system == "torchao32" else build(layers)).cuda()
    if system == "gpu":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    else:
        from torchao.optim import CPUOffloadOptimizer

        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=system == "torchao32",
                                  lr=LR, fused=True)
    step = plain_step(model, opt, ids, tgt)

    def autocast_step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=system == "torchao32"):
            step()

    ms, peak = timed(autocast_step, reps)
    return Row(WORKLOAD, ON_GPU[system], ms, peak, extra={"host_rss_gib": host_rss_gib()})


def child(system: str, layers: int, reps: int, budget: float | None) -> None:
    """Runs one system in this process and prints its row as the last line."""
    if system == "pager":
        row = run_pager(layers, reps, budget)
    elif system == "deepspeed":
        row = run_deepspeed(layers, reps)
    else:
        row = run_on_gpu(system, layers, reps)
    print("ROW " + json.dumps(asdict(row)), flush=True)


def in_process_of_its_own(system: str, args, budget=None) -> Row:
    method = f"pager, budget {budget:g} GiB" if budget is not None else system
    cmd = [sys.executable, "-m", "benchmarks.bench_finetune", "--child", system, "--layers", str(args.layers),
           "--reps", str(args.reps)] + (["--budget", str(budget)] if budget is not None else [])
    run = subprocess.run(cmd, capture_output=True, text=True)
    rows = [line[4:] for line in run.stdout.splitlines() if line.startswith("ROW ")]
    if rows:
        return Row(**json.loads(rows[-1]))
    tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
    skipped = "ModuleNotFoundError" in (run.stderr or "")
    said = "skipped: not installed: " if skipped else f"failed (rc {run.returncode}): "
    return Row(WORKLOAD, method, None, note=said + " / ".join(tail)[-300:])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--budgets", type=float, nargs="*", default=[16.0, 32.0])
    ap.add_argument("--systems", default="pager,deepspeed,torchao,torchao32,gpu")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--child", default=None)
    ap.add_argument("--budget", type=float, default=None)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, args.layers, args.reps, args.budget)
    rows = []
    for system in args.systems.split(","):
        for budget in (args.budgets if system == "pager" else [None]):
            rows.append(in_process_of_its_own(system, args, budget))
            print(rows[-1], flush=True)
            free_cuda()
    reference = next((r for r in rows if r.method.startswith("DeepSpeed") and r.ms), None)
    for r in rows:
        tokens = BATCH * SEQ / (r.ms / 1e3) if r.ms else None
        if r.ms and reference is not None:
            r.ratio, r.reference = r.ms / reference.ms, "DeepSpeed ZeRO-Offload"
        if tokens:
            r.note = f"{tokens:.0f} tokens/s; host RSS {r.extra.get('host_rss_gib', 0):.0f} GiB" + (
                f"; {r.note}" if r.note else "")
    env = environment()
    env["params"] = f"{args.layers} layers of d=4096"
    save(rows, "bench_finetune", env)


if __name__ == "__main__":
    main()
