"""Small models for the tests: a decoder with tied embeddings, a CNN with
BatchNorm, nested blocks, and a NAS supernet."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A decoder whose LM head is tied to the embedding."""

    def __init__(self, vocab=64, d=32, n_layers=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def tiny_cnn(channels=(3, 8, 16, 16, 32)):
    stages = []
    for cin, cout in zip(channels, channels[1:]):
        stages.append(nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()))
    return nn.Sequential(*stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels[-1], 10))


class Outer(nn.Module):
    """A block that holds blocks: its own projection plus two inner layers."""

    def __init__(self, d):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.inner = nn.ModuleList([Layer(d), Layer(d)])

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for layer in self.inner:
            x = layer(x)
        return x


class Nested(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.outers = nn.ModuleList([Outer(d), Outer(d), Outer(d)])
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        for o in self.outers:
            x = o(x)
        return self.out(x)


class SuperLayer(nn.Module):
    """A fixed attention, then one of several feed-forward candidates."""

    def __init__(self, d, widths=(1, 2, 3, 4)):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.candidates = nn.ModuleList(
            nn.Sequential(nn.Linear(d, w * d), nn.GELU(), nn.Linear(w * d, d)) for w in widths
        )
        self.choice = 0

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.candidates[self.choice](x)


class SuperNet(nn.Module):
    def __init__(self, vocab=64, d=32, n_layers=4, widths=(1, 2, 3, 4)):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(SuperLayer(d, widths) for _ in range(n_layers))
        self.head = nn.Linear(d, vocab)

    def set_path(self, path):
        for layer, k in zip(self.layers, path):
            layer.choice = k

    def path_modules(self, path):
        """The blocks a forward on `path` runs, in order."""
        out = []
        for layer, k in zip(self.layers, path):
            out += [layer, layer.candidates[k]]
        return out

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Thin(nn.Module):
    """Layers with little arithmetic per byte: fetches dominate, races show."""

    def __init__(self, d=1024, n=12):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x
