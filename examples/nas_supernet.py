"""Train a ProxylessNAS-style supernet under a budget of about a quarter of
its weights plus Adam state: one path sampled per step, said in advance with
`expect()` so its blocks are prefetched; candidates off the path are neither
fetched nor stepped.

On a GPU: 24 layers (d=1024, candidates of width 2/4/6/8 x d), 4.4 GiB of
weights, 13 GiB with Adam state, under a 3.3 GiB budget. Without one: a small
supernet on the CPU device, checked bit for bit against unpaged training.

    python examples/nas_supernet.py [--steps 20]

The file stands alone: after `pip install pager` it runs from any folder
(the supernet is defined below). `--steps 5` makes the CPU run quicker.
"""

from __future__ import annotations

import argparse
import copy
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import pager


class SelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class SuperLayer(nn.Module):
    """A fixed attention, then one of several feed-forward candidates (widths w x d), the one `choice` says."""

    def __init__(self, d, heads, widths):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads)
        self.candidates = nn.ModuleList(
            nn.Sequential(nn.Linear(d, w * d), nn.GELU(), nn.Linear(w * d, d)) for w in widths
        )
        self.choice = 0

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.candidates[self.choice](self.norm2(x))


class SuperNet(nn.Module):
    """ProxylessNAS-style: each layer a fixed attention and a choice among
    feed-forward candidates of different widths; one path runs per step."""

    def __init__(self, n_layers=24, d=1024, heads=16, widths=(2, 4, 6, 8), vocab=32000):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(SuperLayer(d, heads, widths) for _ in range(n_layers))
        self.head = nn.Linear(d, vocab)

    def set_path(self, path):
        for layer, k in zip(self.layers, path):
            layer.choice = k

    def path_modules(self, path):
        """The modules a path runs: each layer (its attention and norms) and its chosen candidate."""
        return [m for layer, k in zip(self.layers, path) for m in (layer, layer.candidates[k])]

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    if cuda:
        device, size, batch = "cuda", dict(n_layers=24, d=1024, heads=16, vocab=32000), (8, 1024)
    else:
        device, size, batch = "cpu", dict(n_layers=8, d=64, heads=4, vocab=256), (4, 32)
    net = SuperNet(**size)
    reference = None if cuda else copy.deepcopy(net)
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    budget = int(0.25 * 3 * weights)  # a quarter of weights + Adam's two moments

    pager.wrap(net, budget=budget, device=device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3) if reference is not None else None
    pg = pager.of(net)
    print(
        f"supernet: {pager.format_bytes(weights)} weights, {pager.format_bytes(4 * weights)} with grads and Adam; "
        f"budget {pager.format_bytes(budget)}; {len(pg.blocks)} blocks"
    )

    rng = random.Random(0)
    n_cand = len(net.layers[0].candidates)
    t0 = time.perf_counter()
    for step in range(args.steps):
        ids = torch.randint(0, size["vocab"], batch, device=device)
        path = [rng.randrange(n_cand) for _ in net.layers]
        net.set_path(path)
        pg.expect(net.path_modules(path))  # the sampled path is known before forward
        loss = F.cross_entropy(net(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if reference is not None:
            reference.set_path(path)
            ref_loss = F.cross_entropy(reference(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert torch.equal(loss, ref_loss), (step, loss, ref_loss)
        if step % 5 == 4:
            if cuda:
                torch.cuda.synchronize()
            print(f"step {step + 1}: loss {loss.item():.3f}, {1e3 * (time.perf_counter() - t0) / 5:.0f} ms/step")
            t0 = time.perf_counter()
    s = pg.stats()
    print(s)
    assert s.peak_resident_bytes <= budget
    if reference is not None:
        print("losses equal to unpaged training at every step, bit for bit: True")
    pager.unwrap(net)


if __name__ == "__main__":
    main()
