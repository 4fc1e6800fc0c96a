"""Compressed pages ([Note: compressed pages] in codec/compress.py): a
7B-shaped bf16 decoder (16 layers, ~6.5 GB of layers) with every layer
streamed (a budget of two layers), plain pages against lossless, fp8 and int4
pages, each against the PCIe floor of the uncompressed bytes. Also: each
codec's page ratio, the decoder's GB/s on one layer's page, the encoding cost
at wrap per GB, and the lossy codecs' error on the logits of random prompts.

The weights are random, drawn as trained weights are distributed at init
(normal, std 0.02, Hugging Face's initializer_range), not nn.Linear's uniform.

    python -m benchmarks.bench_compress [--layers 16] [--tokens 512] [--reps 5]
    python -m benchmarks.bench_compress --sweep   # other budgets, token counts and shapes
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import pager
from benchmarks.harness import GiB, Row, environment, free_cuda, interleaved_ms, pinned_h2d_gbps, save, time_ms
from benchmarks.models import build, layer_bytes
from pager.base.block import layout
from pager.codec.compress import PIECE_BYTES, encode
from pager.codec.kernels import decode_on_device
from pager.engine.transport import STAGING_SLOTS

CODECS = (None, "lossless", "fp8", "int4")


def init_like_trained(model) -> None:
    with torch.no_grad():
        for layer in model.layers:
            for p in layer.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)


def decoder_gbps(layer, codec, reps):
    """Output GB/s of the decoder over one layer's page, staged on the device
    (the kernels alone: no copy)."""
    named = list(layer.state_dict().items())
    slots, nbytes = layout(named)
    plain = torch.zeros(nbytes, dtype=torch.uint8)
    for slot, (_n, t) in zip(slots, named):
        slot.view_of(plain).copy_(t)
    encoded, page = encode(codec, slots, plain, device=torch.device("cuda"))
    staged, out = page.cuda(), torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    coded = [p for p in encoded.pieces if p.kind != "raw"]

    def run():
        for piece in coded:
            decode_on_device(staged[piece.src: piece.src + piece.src_bytes], piece, out[piece.dst: piece.dst + piece.dst_bytes])

    ms = time_ms(run, warmup=3, reps=reps)
    return sum(p.dst_bytes for p in coded) / (ms / 1e3) / 1e9, encoded.page_bytes / nbytes


def logits_error(model, prompts, want):
    """(max abs, mean abs) difference of the logits, and the share of
    positions whose top-1 token agrees."""
    worst, total, count, agree = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for p, w in zip(prompts, want):
            got = model(p).float()
            diff = (got - w).abs()
            worst = max(worst, diff.max().item())
            total += diff.sum().item()
            count += diff.numel()
            agree += (got.argmax(-1) == w.argmax(-1)).sum().item()
    positions = sum(p.numel() for p in prompts)
    return worst, total / count, agree / positions


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--codecs", default="plain,lossless,fp8,int4")
    ap.add_argument("--whole-layers", action="store_true",
                    help="also run each codec with whole layers as blocks (blocks=layers: no parts split off)")
    ap.add_argument("--sweep", action="store_true", help="budgets, token counts and shapes (no error figures)")
    args = ap.parse_args(argv)
    if args.sweep:
        return sweep(args)
    env = environment()
    bw = pinned_h2d_gbps()
    env["pinned_h2d_GBps"] = round(bw, 1)
    print(f"pinned H2D: {bw:.1f} GB/s")
    torch.manual_seed(0)

    gpu_model = build("cuda", n_layers=args.layers, vocab=args.vocab).eval()
    init_like_trained(gpu_model)
    per_layer = layer_bytes(gpu_model)
    total = per_layer * args.layers
    floor_ms = total / (bw * 1e9) * 1e3
    x = torch.randint(0, args.vocab, (1, args.tokens), device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    prompts = [torch.randint(0, args.vocab, (1, 128), device="cuda", generator=g) for _ in range(args.prompts)]
    with torch.no_grad():
        want = [gpu_model(p).float() for p in prompts]

    def gpu_fwd():
        with torch.no_grad():
            gpu_model(x)

    wname = f"7B-shape fwd 1x{args.tokens}, every layer streamed"
    rows = [Row(wname, "all on GPU", time_ms(gpu_fwd, reps=4 * args.reps), None, None, ""),
            Row(wname, "PCIe floor, uncompressed", floor_ms, None, 1.0, "itself",
                f"{total / 1e9:.2f} GB at {bw:.1f} GB/s")]
    cpu_model = build("meta", n_layers=args.layers, vocab=args.vocab).to_empty(device="cpu").eval()
    cpu_model.load_state_dict(gpu_model.state_dict())
    layer0 = copy.deepcopy(gpu_model.layers[0])
    del gpu_model
    free_cuda()
    remainder = sum(t.numel() * t.element_size() for n, t in cpu_model.state_dict().items() if not n.startswith("layers."))
    staging = STAGING_SLOTS * PIECE_BYTES
    budget = remainder + 2 * per_layer + staging + (64 << 20)  # the same for every row
    print(f"budget {budget / GiB:.2f} GiB: remainder, two layers, the staging ring")

    runs = [(None if c == "plain" else c, False) for c in args.codecs.split(",")]
    if args.whole_layers:
        runs += [(codec, True) for codec, _w in runs]
    for codec, whole in runs:
        model = copy.deepcopy(cpu_model)
        t0 = time.perf_counter()
        # (layer0 and the reference logits `want` beside it on the GPU are the benchmark's: the budget is sized
        # for pager's blocks, the same for every row)
        pager.wrap(model, budget=budget, device="cuda", compress=codec, blocks=list(model.layers) if whole else None,
                   budget_covers="pager")
        torch.cuda.synchronize()
        wrap_s = time.perf_counter() - t0
        p = pager.of(model)

        def fwd():
            with torch.no_grad():
                model(x)

        fwd()  # learn the order
        (ms, host_ms), = interleaved_ms([fwd], warmup=2, reps=args.reps)
        p.reset()
        fwd()
        torch.cuda.synchronize()
        s = p.stats()
        worst, mean, top1 = logits_error(model, prompts, want)
        gbps, page_ratio = decoder_gbps(layer0, codec, args.reps) if codec else (None, 1.0)
        note = (f"{len(p.blocks)} blocks; pages {page_ratio:.3f}x of plain; moved {s.h2d_bytes / 1e9:.2f} GB/fwd at "
                f"{s.h2d_bytes / (ms / 1e3) / 1e9:.1f} GB/s; host enqueue {host_ms:.1f} ms; wrap {wrap_s:.1f} s "
                f"({wrap_s / (total / GiB):.2f} s/GiB)" + (f"; decoder {gbps:.0f} GB/s out" if gbps else "")
                + f"; logits vs unpaged: max {worst:.3g}, mean {mean:.3g}, top-1 agree {100 * top1:.2f}%")
        label = f"pager, {codec or 'plain'} pages" + (", whole layers" if whole else "")
        rows.append(Row(wname, label, ms, None, ms / floor_ms, "PCIe floor, uncompressed", note,
                        {"h2d_bytes": s.h2d_bytes, "page_ratio": page_ratio, "wrap_s": wrap_s, "decoder_GBps": gbps,
                         "host_ms": host_ms, "blocks": len(p.blocks), "logits_max_abs": worst,
                         "logits_mean_abs": mean, "top1": top1, "budget": budget, "stall_s": s.stall_seconds}))
        print(rows[-1], flush=True)
        pager.unwrap(model)
        del model, p
        free_cuda()
    save(rows, "compress", env)
    return rows


SWEEP = [  # (name, layers, d, ff, heads, layers of room (None: half the model), tokens)
    ("7B-shape, half budget, 1x512", 16, 4096, 11008, 32, None, 512),
    ("7B-shape, 2 layers, 1 token (decode-like)", 16, 4096, 11008, 32, 2, 1),
    ("7B-shape, 2 layers, 8x2048 (compute-heavy)", 16, 4096, 11008, 32, 2, 2048),
    ("1B-shape (d 2048, ff 5632), 2 layers, 1x512", 22, 2048, 5632, 16, 2, 512),
    ("13B-shape (d 5120, ff 13824), 2 layers, 1x512", 10, 5120, 13824, 40, 2, 512),
]


def sweep(args):
    """Each codec against plain pages at other budgets, token counts and
    shapes; the ratio is to the PCIe floor of the bytes plain pages must move
    at that budget (what the plain row moved)."""
    env = environment()
    bw = pinned_h2d_gbps()
    env["pinned_h2d_GBps"] = round(bw, 1)
    rows = []
    for name, layers, d, ff, heads, room_layers, tokens in SWEEP:
        torch.manual_seed(0)
        gpu_model = build("cuda", n_layers=layers, d=d, ff=ff, heads=heads).eval()
        init_like_trained(gpu_model)
        per_layer = layer_bytes(gpu_model)
        cpu_model = build("meta", n_layers=layers, d=d, ff=ff, heads=heads).to_empty(device="cpu").eval()
        cpu_model.load_state_dict(gpu_model.state_dict())
        del gpu_model
        free_cuda()
        batch = 8 if tokens == 2048 else 1
        x = torch.randn(batch, tokens, d, device="cuda", dtype=torch.bfloat16)
        room = room_layers * per_layer if room_layers else layers * per_layer // 2
        budget = room + STAGING_SLOTS * PIECE_BYTES + (64 << 20)
        plain_bytes = None
        for codec in (None, "lossless", "fp8", "int4"):
            model = copy.deepcopy(cpu_model)
            pager.wrap(model, budget=budget, device="cuda", compress=codec)
            p = pager.of(model)

            def fwd():
                with torch.no_grad():
                    model(x)

            fwd()
            (ms, host_ms), = interleaved_ms([fwd], warmup=2, reps=args.reps)
            p.reset()
            fwd()
            torch.cuda.synchronize()
            st = p.stats()
            plain_bytes = plain_bytes or st.h2d_bytes
            floor_ms = plain_bytes / (bw * 1e9) * 1e3
            rows.append(Row(name, f"pager, {codec or 'plain'} pages", ms, None, ms / floor_ms,
                            "floor of the bytes plain pages move",
                            f"{len(p.blocks)} blocks; moved {st.h2d_bytes / 1e9:.2f} GB/fwd at "
                            f"{st.h2d_bytes / (ms / 1e3) / 1e9:.1f} GB/s; host enqueue {host_ms:.1f} ms",
                            {"h2d_bytes": st.h2d_bytes, "host_ms": host_ms, "budget": budget}))
            print(rows[-1], flush=True)
            pager.unwrap(model)
            del model, p
            free_cuda()
        del cpu_model
    save(rows, "compress_sweep", env)
    return rows


if __name__ == "__main__":
    main()
