"""Data-parallel training steps with paging on every rank (torchrun).

Each rank trains the same fp32 decoder (AdamW) on its own batch under its own
budget; pager averages each block's gradients over the group as its backward
ends. Per rank, three runs of the same step: the paged model alone
(`process_group=False`: no averaging, what one GPU does), the paged model in
the group, the paged model with block owners (`block_owners=True`: each
block's update and optimizer state on one rank, weights in one host copy per
node; two ranks or more), and, when weights + grads + AdamW state fit the
GPU, DDP over the same group; then the peers over the same group
(`--peers`, each skipped with a line saying so where it is not installed):
FSDP2 all on the GPUs, FSDP2 with `CPUOffloadPolicy`, DeepSpeed ZeRO-3 with
parameters and optimizer offloaded to the CPU (its CPU Adam builds at first
use). The ratio of the first two is what the averaging costs; across world
sizes, samples/s per rank at the same budget is the scaling. Host memory:
what the run added to each rank's PSS (proportional set size: a page shared
by N ranks counts 1/N on each), summed over the ranks, and pager's host
pages by kind. The links: each rank's pinned host-to-device rate alone and
with every rank copying at once (GPUs behind one PCIe switch share it, and
so do all of a host's GPUs its memory). Steps: `--warmup` of them each
waited for, `--reps` more waited for (their median, and each step's time
listed: where pager settles), and `--reps` run back to back, as a training
loop that does not wait for the GPU: the figure reported.

    torchrun --nproc-per-node 2 -m benchmarks.bench_dp [--layers 12] [--budget-gib 4] [--warmup 4] [--reps 6] [--peers ...]
    torchrun --nproc-per-node 1 -m benchmarks.bench_dp      # one GPU: the averaging's own cost
    ... --profile DIR   # a torch.profiler trace of two block-owner steps per rank (gzipped Chrome JSON; python -m benchmarks.profile_summary reads it)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics

import psutil

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pager
from benchmarks.harness import GiB, Row, environment, event_ms, free_cuda, pinned_h2d_gbps, profiled, save
from benchmarks.models import Decoder

VOCAB = 32000


def step_times(step, warmup: int, reps: int) -> tuple[float, float, list]:
    """(ms a step over `reps` steps run back to back, as a training loop that
    does not wait for the GPU; median ms of `reps` steps each waited for;
    every waited-for step's ms, warm-up first: pager learns the order and
    where updates run over its first steps, and the list shows when the step
    settles)."""
    each = [event_ms(step) for _ in range(warmup + reps)]
    return event_ms(step, reps) / reps, statistics.median(each[warmup:]), each


def step_fn(model, opt, ids, tgt):
    def step():
        F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return step


def pss_gib() -> float:
    return psutil.Process().memory_full_info().pss / GiB


def host_pages_gib(model) -> dict:
    """This rank's host pages by kind; weights in the node's shared copy
    are counted by the node's first rank only."""
    p, out = pager.of(model), {}
    first = dist.get_rank() == 0 if p.reducer is not None else True
    for block in p.all_blocks():
        for kind, seg in block.segments.items():
            if seg.host is None or (p.engine.host.is_shared(p, seg.host) and not first):
                continue
            out[kind] = out.get(kind, 0.0) + seg.nbytes / GiB
    return out


def summed(value: float) -> float:
    t = torch.tensor([value], device="cuda")
    dist.all_reduce(t)
    return float(t)


def link_gbps(rank: int, world: int) -> tuple[float, float]:
    """This rank's pinned host-to-device GB/s alone (ranks in turn) and with
    every rank copying at once."""
    alone = 0.0
    for r in range(world):
        dist.barrier()
        if r == rank:
            alone = pinned_h2d_gbps()
    dist.barrier()
    together = pinned_h2d_gbps()
    free_cuda()
    return alone, together


def peer_rows(names: str, base, ids, tgt, args, world: int, workload: str, first: float) -> list:
    """The peers `names` (comma-separated keys of PEERS) on the same steps, each a Row."""
    rows = []
    for name in filter(None, names.split(",")):
        if name not in PEERS:
            raise SystemExit(f"bench_dp: unknown peer {name!r}; choose from {', '.join(PEERS)}")
        before = pss_gib()
        try:
            label, step = PEERS[name](copy.deepcopy(base), ids, tgt)
        except ImportError as e:
            rows.append(Row(workload, name, None, note=f"not installed ({e}): not run"))
            if dist.get_rank() == 0:
                print(f"{name}: not installed ({e}); skipped", flush=True)
            continue
        torch.cuda.reset_peak_memory_stats()
        t, waited, _ = step_times(step, args.warmup, args.reps)
        added_all = summed(pss_gib() - before)
        note = (f"{ids.shape[0] * world / (t / 1e3):.2f} samples/s in all; each step waited for: {waited:.1f} ms; "
                f"host PSS added {added_all:.1f} GiB all ranks")
        rows.append(Row(workload, label, t, torch.cuda.max_memory_allocated() / GiB, t / first,
                        "pager, one rank's step", note))
        if dist.get_rank() == 0:
            print(f"{label}: {t:.1f} ms; {note}", flush=True)
        del step
        free_cuda()
    return rows


def fsdp2(offload: bool):
    def build(model, ids, tgt):
        from benchmarks.bench_train import fsdp2_sharded

        model = fsdp2_sharded(model, offload)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        label = "FSDP2 + CPUOffloadPolicy" if offload else "FSDP2, all on the GPUs"
        return label, step_fn(model, opt, ids, tgt)
    return build


def deepspeed_zero3(model, ids, tgt):
    from benchmarks.bench_train import deepspeed_zero3_step

    return "DeepSpeed ZeRO-3, parameters and optimizer offloaded", deepspeed_zero3_step(model, ids, tgt)


PEERS = {"fsdp2": fsdp2(False), "fsdp2-offload": fsdp2(True), "deepspeed": deepspeed_zero3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=2048)  # (not --d: torchrun would take it for one of its own)
    ap.add_argument("--budget-gib", type=float, default=4.0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--runs", default="alone,averaged,owners", help="pager's runs: alone, averaged, owners")
    ap.add_argument("--peers", default="fsdp2,fsdp2-offload,deepspeed")
    ap.add_argument("--profile", default=None, help="a folder: trace two block-owner steps on every rank there")
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    g = torch.Generator(device="cuda").manual_seed(rank)
    ids = torch.randint(0, VOCAB, (args.batch, args.seq), device="cuda", generator=g)
    tgt = torch.randint(0, VOCAB, (args.batch, args.seq), device="cuda", generator=g)
    base = Decoder(n_layers=args.layers, d=args.width, ff=int(args.width * 2.75), heads=16, vocab=VOCAB)
    state_gib = 4 * sum(p.numel() * 4 for p in base.parameters()) / GiB  # weights, grads, AdamW's two
    rows, ms = [], {}
    alone, together = link_gbps(rank, world)
    links = torch.tensor([alone, together], device="cuda")
    gathered = [torch.zeros_like(links) for _ in range(world)]
    dist.all_gather(gathered, links)
    links_note = ("pinned h2d GB/s per rank, alone: " + ", ".join(f"{float(g[0]):.1f}" for g in gathered)
                  + "; all at once: " + ", ".join(f"{float(g[1]):.1f}" for g in gathered))
    if rank == 0:
        print(links_note, flush=True)
    workload = (f"{args.layers}-layer d={args.width} fp32 decoder ({state_gib / 4:.1f} GiB weights, "
                f"{state_gib:.1f} GiB with grads and AdamW state), {args.batch}x{args.seq} tokens per rank, "
                f"{world} rank(s)")
    runs = [("pager, one rank's step (process_group=False)", False, {}, "alone"),
            ("pager, gradients averaged over the group", dist.group.WORLD, {}, "averaged")]
    if world > 1:
        runs.append(("pager, block owners", dist.group.WORLD, {"block_owners": True}, "owners"))
    runs = [r[:3] for r in runs if r[3] in args.runs.split(",")]
    for label, group, options in runs:
        model = copy.deepcopy(base)
        before = pss_gib()
        pager.wrap(model, budget=f"{args.budget_gib}GiB", process_group=group, dist_timeout=120, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = step_fn(model, opt, ids, tgt)
        pager.of(model).reset()
        torch.cuda.reset_peak_memory_stats()
        ms[label], waited, each = step_times(step, args.warmup, args.reps)
        s = pager.of(model).stats()
        if args.profile and options.get("block_owners"):
            os.makedirs(args.profile, exist_ok=True)
            profiled(step, os.path.join(args.profile, f"owners_rank{rank}_of{world}.json.gz"))
        added = pss_gib() - before
        added_all = summed(added) if group is not False else added
        pages = host_pages_gib(model)
        pages_all = {k: summed(pages.get(k, 0.0)) if group is not False else pages.get(k, 0.0)
                     for k in ("weights", "grads", "state")}  # (the same collectives on every rank)
        note = (f"{args.batch * world / (ms[label] / 1e3):.2f} samples/s in all; each step waited for: {waited:.1f} ms; "
                f"host PSS added {added:.1f} GiB "
                f"this rank, {added_all:.1f} GiB all ranks; host pages (all ranks) "
                + ", ".join(f"{k} {v:.1f}" for k, v in pages_all.items())
                + f" GiB; {s.h2d_bytes / max(s.steps, 1) / 1e9:.1f} GB h2d per step; averaged "
                f"{s.reduced_bytes / 1e9:.1f} GB in {s.reductions} reductions; waited "
                f"{s.owner_wait_seconds * 1e3 / max(s.steps, 1):.1f} ms/step for owners, "
                f"{s.host_step_wait_seconds * 1e3 / max(s.steps, 1):.1f} ms/step for host updates "
                f"({s.host_steps} on the host); steps (ms): " + " ".join(f"{t:.0f}" for t in each))
        rows.append(Row(workload, label, ms[label], torch.cuda.max_memory_allocated() / GiB, note=note))
        if rank == 0:
            print(f"{label}: {ms[label]:.1f} ms; {note}", flush=True)
        pager.unwrap(model)
        del model, opt, step
        free_cuda()
    first = next(iter(ms.values()))
    for r in rows:
        r.ratio, r.reference = r.ms / first, "pager, one rank's step"
    free_bytes, _total = torch.cuda.mem_get_info()
    if state_gib * GiB * 1.3 < free_bytes:
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base).cuda(), device_ids=[local])
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        torch.cuda.reset_peak_memory_stats()
        t, _, _ = step_times(step_fn(ddp, opt, ids, tgt), args.warmup, args.reps)
        rows.append(Row(workload, "DDP, all on the GPU", t, torch.cuda.max_memory_allocated() / GiB, t / first,
                        "pager, one rank's step", f"{args.batch * world / (t / 1e3):.2f} samples/s in all"))
        del ddp, opt
        free_cuda()
    else:
        rows.append(Row(workload, "DDP, all on the GPU", None, note="does not fit the GPU: not run"))
    rows += peer_rows(args.peers, base, ids, tgt, args, world, workload, first)
    if rank == 0:
        env = environment()
        env["links"] = links_note
        save(rows, f"bench_dp_{world}", env)
        print(f"\n{links_note}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
