"""Serve two models from one GPU budget: a small server loop on the standard library.

A chat model (a decoder generating greedily) and an embedding model (an
encoder, mean-pooled) share one `pager.Pool` whose budget holds about 1.5 of
them; two worker threads take requests from a queue, so requests of both
models run at once and wait for room rather than fail. Each request prints
its latency; the pool's stats close the run.

Requests come from standard input, one per line, `chat <text>` or
`embed <text>` (an empty line or end of input stops), or with `--demo N`
from N requests alternating between the models:

    python examples/serve.py --demo 8
    printf 'chat hello\\nembed a sentence\\n' | python examples/serve.py

On a GPU the models are 7B-shaped bf16 decoders of `--layers` layers (6.5 GB
each at 16); without one, small fp32 models on the CPU device, each answer
checked bit for bit against the unwrapped model.

The file stands alone: after `pip install pager` it runs from any folder
(the models are defined below). `--layers 2` makes the CPU run quicker.
"""

from __future__ import annotations

import argparse
import copy
import queue
import sys
import threading
import time

import torch
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
    """Token ids to logits through a stack of decoder layers (7B-shaped by default); each layer is a block."""

    def __init__(self, n_layers=16, d=4096, ff=11008, heads=32, vocab=32000):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(DecoderLayer(d, ff, heads) for _ in range(n_layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return self.head(x) if self.head is not None else x


def layer_bytes(model: Decoder) -> int:
    return sum(p.numel() * p.element_size() for p in model.layers[0].parameters())


class Embedder(nn.Module):
    """An encoder whose mean-pooled last hidden state is the embedding."""

    def __init__(self, vocab, **dims):
        super().__init__()
        self.decoder = Decoder(vocab=vocab, **dims)
        self.decoder.head = None

    def forward(self, ids):
        return torch.nn.functional.normalize(self.decoder(ids).mean(1), dim=-1)


def tokenize(text: str, vocab: int, device) -> torch.Tensor:
    ids = list(text.encode())[:256] or [0]
    return torch.tensor([[i % vocab for i in ids]], device=device)


def build(cuda: bool, layers: int):
    torch.manual_seed(0)
    if cuda:
        dims, vocab, dtype = {}, 32000, torch.bfloat16
    else:
        dims, vocab, dtype = {"d": 128, "ff": 344, "heads": 4}, 256, torch.float32
    chat = Decoder(n_layers=layers, vocab=vocab, **dims).to(dtype).eval()
    embed = Embedder(vocab, n_layers=layers, **dims).to(dtype).eval()
    return chat, embed, vocab


def answer(models, vocab, device, line: str):
    kind, _, text = line.partition(" ")
    ids = tokenize(text, vocab, device)
    with torch.inference_mode():
        if kind == "chat":
            for _ in range(8):  # greedy, without a cache: each token reruns the prompt so far
                ids = torch.cat([ids, models["chat"](ids)[:, -1:].argmax(-1)], dim=1)
            return ids[0, -8:]
        if kind == "embed":
            return models["embed"](ids)[0]
    raise ValueError(f"unknown request {kind!r}: say 'chat <text>' or 'embed <text>'")


def main(argv=None):
    ap = argparse.ArgumentParser()
    cuda = torch.cuda.is_available()
    ap.add_argument("--layers", type=int, default=16 if cuda else 6)
    ap.add_argument("--budget", default=None, help="the pool's budget (default: 1.5 of one model)")
    ap.add_argument("--demo", type=int, default=0, help="serve N alternating requests instead of reading stdin")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    device = "cuda" if cuda else "cpu"

    chat, embed, vocab = build(cuda, args.layers)
    references = None if cuda else {"chat": copy.deepcopy(chat), "embed": copy.deepcopy(embed)}
    size = sum(p.numel() * p.element_size() for p in chat.parameters())
    pool = pager.Pool(budget=args.budget or int(1.5 * size), device=device)
    models = {"chat": pager.wrap(chat, pool=pool, name="chat"), "embed": pager.wrap(embed, pool=pool, name="embed")}
    print(
        f"pool: {pager.format_bytes(pool.budget_bytes)} on {device} for two models of {pager.format_bytes(size)} "
        f"({args.layers} layers of {pager.format_bytes(layer_bytes(chat))})",
        flush=True,
    )

    requests: queue.Queue = queue.Queue()
    printing = threading.Lock()
    failures = []

    def worker():
        while True:
            item = requests.get()
            if item is None:
                return
            n, line = item
            t0 = time.perf_counter()
            try:
                out = answer(models, vocab, device, line)
                if cuda:
                    torch.cuda.current_stream().synchronize()
                ms = (time.perf_counter() - t0) * 1e3
                if references is not None:
                    same = torch.equal(out, answer(references, vocab, device, line))
                    if not same:
                        failures.append(line)
                with printing:
                    shown = out.tolist()[:4] if out.dtype != torch.long else out.tolist()
                    print(
                        f"#{n} {line[:40]!r}: {ms:.1f} ms -> {shown}"
                        + ("" if references is None else f" (equal to unwrapped: {same})"),
                        flush=True,
                    )
            except Exception as e:  # noqa: BLE001 - a request fails, the server goes on
                failures.append(line)
                with printing:
                    print(f"#{n} {line[:40]!r}: failed: {e}", flush=True)

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(args.workers)]
    for w in workers:
        w.start()
    if args.demo:
        lines = [f"{'chat' if i % 2 == 0 else 'embed'} request number {i}" for i in range(args.demo)]
    else:
        lines = []
        for line in sys.stdin:
            if not line.strip():
                break
            lines.append(line.strip())
    for n, line in enumerate(lines):
        requests.put((n, line))
    for _ in workers:
        requests.put(None)
    for w in workers:
        w.join()
    print(pool.report())
    s = pool.stats()
    assert s.peak_resident_bytes <= s.budget_bytes
    for model in models.values():
        pager.unwrap(model)
    if failures:
        sys.exit(f"{len(failures)} request(s) failed or differed from the unwrapped model: {failures[:3]}")


if __name__ == "__main__":
    main()
