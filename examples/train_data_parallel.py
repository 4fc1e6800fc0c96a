"""Data-parallel training with paging on every rank: each rank trains the
same decoder on its own batches under its own budget, and pager averages each
block's gradients over the ranks as soon as the block's backward ends
(the values of `DistributedDataParallel`). Gradient accumulation uses
`pager.of(model).no_sync()`, as DDP's `no_sync()`. `--block-owners` has each
block updated by one rank, which alone holds its AdamW state and writes its
weights into the node's one host copy (`wrap(..., block_owners=True)`).

On GPUs, one rank per GPU (NCCL):

    torchrun --nproc-per-node 2 examples/train_data_parallel.py [--steps 10]

Without GPUs it runs on the CPU device with gloo; run by plain `python`, it
starts two local ranks itself. Each rank then also trains the same model
under DDP on the same data and checks that the weights agree bit for bit.

    python examples/train_data_parallel.py

The file stands alone: after `pip install pager` it runs from any folder
(the model is defined below). `--steps 2` makes the CPU run quicker.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import pager


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


class DecoderLayer(nn.Module):
    """A Llama-like layer: causal attention and a gated MLP, each after an RMSNorm."""

    def __init__(self, d, ff, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    """Token ids to logits through a stack of decoder layers; each layer is a block."""

    def __init__(self, n_layers, d, ff, heads, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(DecoderLayer(d, ff, heads) for _ in range(n_layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def train(rank: int, world: int, steps: int, accumulate: int, owners: bool = False) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        # (ranks spawned here on a machine of one GPU share it)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        size, batch = dict(n_layers=16, d=2048, ff=5632, heads=16, vocab=32000), (2, 1024)  # 3.8 GB of fp32
    else:
        size, batch = dict(n_layers=6, d=64, ff=176, heads=4, vocab=256), (2, 32)
    torch.manual_seed(rank)  # every rank starts from rank 0's weights all the same: wrap broadcasts them
    model = Decoder(**size)
    # 40% of what a step holds without pager: weights, gradients, AdamW's two states.
    budget = int(0.4 * 4 * sum(p.numel() * p.element_size() for p in model.parameters()))
    ddp = None if cuda else torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    model = pager.wrap(model, budget=budget, block_owners=owners)  # the process group is picked up
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3) if ddp is not None else None
    device = pager.of(model).device
    data = torch.Generator(device=device).manual_seed(1000 + rank)  # each rank its own batches
    for step in range(steps):
        t0 = time.perf_counter()
        for micro in range(accumulate):
            ids = torch.randint(0, size["vocab"], batch, device=device, generator=data)
            last = micro == accumulate - 1
            for m, sync in ((model, pager.of(model).no_sync), (ddp, ddp.no_sync if ddp else None)):
                if m is None:
                    continue
                with sync() if not last else contextlib.nullcontext():
                    logits = m(ids[:, :-1])
                    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()) / accumulate
                    loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), opt.zero_grad()
        if ddp is not None:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            ddp_opt.step(), ddp_opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        if rank == 0:
            print(f"step {step}: loss {loss.item() * accumulate:.4f}, {time.perf_counter() - t0:.2f} s")
    s = pager.of(model).stats()
    if rank == 0:
        print(
            f"{world} ranks: {s.reductions} block reductions, {s.reduced_bytes / 1e9:.3f} GB averaged per rank; "
            f"peak blocks on the device {s.peak_resident_bytes / 2**20:.1f} MiB"
        )
    if owners:
        t0 = time.perf_counter()
        state = opt.state_dict()  # (every rank: gathered from the blocks' owners of its node)
        if rank == 0:
            held = sum(
                v.numel() * v.element_size()
                for e in state["state"].values()
                for v in e.values()
                if isinstance(v, torch.Tensor)
            )
            print(f"optimizer state gathered: {held / 1e9:.2f} GB in {time.perf_counter() - t0:.2f} s")
        if ddp is not None:
            ref = ddp_opt.state_dict()["state"]
            assert all(torch.equal(v, ref[i][k]) for i, e in state["state"].items() for k, v in e.items()), (
                "pager's gathered optimizer state and DDP's disagree"
            )
    if ddp is not None:
        for p, q in zip(model.parameters(), ddp.module.parameters()):
            assert torch.equal(p.detach().clone(), q.detach()), "pager and DDP disagree"
        if rank == 0:
            print("the same weights as DistributedDataParallel, bit for bit, on every rank")
    pager.unwrap(model)


def _spawned(rank: int, world: int, init: str, steps: int, accumulate: int, owners: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        train(rank, world, steps, accumulate, owners)
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--accumulate", type=int, default=2, help="micro-steps per step (all but the last in no_sync)")
    ap.add_argument("--block-owners", action="store_true", help="each block's update and state on one rank")
    args = ap.parse_args()
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args.steps, args.accumulate, args.block_owners)
        finally:
            dist.destroy_process_group()
        return
    world = 2
    init = os.path.join(tempfile.mkdtemp(), "init")
    print(
        f"not started by torchrun: running {world} local ranks (gloo, "
        f"{'GPU' if torch.cuda.is_available() else 'CPU device'})"
    )
    torch.multiprocessing.spawn(
        _spawned, args=(world, init, args.steps, args.accumulate, args.block_owners), nprocs=world
    )


if __name__ == "__main__":
    main()
