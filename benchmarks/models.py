"""Benchmark models: a 7B-shaped decoder stack (Llama-like layers)."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


class DecoderLayer(nn.Module):
    def __init__(self, d=4096, ff=11008, heads=32):
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
    def __init__(self, n_layers=16, d=4096, ff=11008, heads=32, vocab=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, d) if vocab else None
        self.layers = nn.ModuleList(DecoderLayer(d, ff, heads) for _ in range(n_layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False) if vocab else None
        self.gradient_checkpointing = False  # as Hugging Face models: each layer recomputed in the backward

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        x = self.norm(x)
        return self.head(x) if self.head is not None else x


def build(device="cpu", dtype=torch.bfloat16, **kw) -> Decoder:
    """A decoder with random weights, built fast (on the GPU when asked)."""
    with torch.device(device):
        model = Decoder(**kw).to(dtype)
    return model


def layer_bytes(model: Decoder) -> int:
    return sum(p.numel() * p.element_size() for p in model.layers[0].parameters())


# ---------------------------------------------------------------- supernet
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
        return [m for layer, k in zip(self.layers, path) for m in (layer, layer.candidates[k])]

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
