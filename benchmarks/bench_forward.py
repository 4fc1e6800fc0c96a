"""Forward of a 7B-shaped bf16 decoder (16 layers, ~6.5 GB of layers) whose
weights live on the host: pager at several budgets vs all-on-GPU, the PCIe
floor, and the peers that are installed.

    python -m benchmarks.bench_forward [--layers 16] [--tokens 512] [--reps 5]
"""

from __future__ import annotations

import argparse
import copy

import torch

import pager
from benchmarks.harness import (
    GiB, Row, environment, free_cuda, interleaved_ms, peak_during, pinned_h2d_gbps, save, time_ms,
)
from benchmarks.models import build, layer_bytes


def run_pager(model, x, budget, reps):
    pg = pager.of(model)
    pg.set_budget(budget)

    def fwd():
        with torch.no_grad():
            model(x)

    fwd()  # learn the order
    # Short forwards (everything resident) need more runs for a stable median.
    ms = time_ms(fwd, warmup=2, reps=reps if pg.budget_bytes < 16 * GiB else 4 * reps)
    pg.reset()
    fwd()
    torch.cuda.synchronize()
    s = pg.stats()
    return ms, s


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--peers", default="accelerate,to_loop")
    ap.add_argument("--compute-bound", action="store_true", help="also run 8x2048 tokens")
    args = ap.parse_args(argv)
    env = environment()
    bw = pinned_h2d_gbps()
    env["pinned_h2d_GBps"] = round(bw, 1)
    print(f"pinned H2D: {bw:.1f} GB/s")

    gpu_model = build("cuda", n_layers=args.layers).eval()
    per_layer = layer_bytes(gpu_model)
    total = per_layer * args.layers
    rows = []
    workloads = [("7B-shape fwd %dx%d" % (args.batch, args.tokens), args.batch, args.tokens)]
    if args.compute_bound:
        workloads.append(("compute-bound fwd 8x2048", 8, 2048))

    cpu_model = build("meta", n_layers=args.layers).to_empty(device="cpu").eval()
    cpu_model.load_state_dict(gpu_model.state_dict())
    peers_cpu = {name: copy.deepcopy(cpu_model) for name in args.peers.split(",") if name}
    twins = [copy.deepcopy(cpu_model) for _ in range(2)]  # for the interleaved half-budget rows
    # (every paged row runs beside `gpu_model`, left on the GPU for the ratios and the interleaved runs: the
    # reference is the benchmark's, the budgets are sized for pager's blocks, so they bound pager alone)
    pager.wrap(cpu_model, budget="20GiB", device="cuda", budget_covers="pager")
    paged = cpu_model
    slack = 64 << 20  # the remainder (final norm) and allocator rounding

    for wname, b, t in workloads:
        x = torch.randn(b, t, 4096, device="cuda", dtype=torch.bfloat16)

        def gpu_fwd():
            with torch.no_grad():
                gpu_model(x)

        gpu_ms = time_ms(gpu_fwd, reps=4 * args.reps)
        rows.append(Row(wname, "all on GPU", gpu_ms, peak_during(gpu_fwd), 1.0, "itself"))
        floor_ms = total / (bw * 1e9) * 1e3
        rows.append(Row(wname, "PCIe floor (all layers once)", floor_ms, None, None, "", f"{total / 1e9:.2f} GB at {bw:.1f} GB/s"))

        budgets = [("pager, budget 2 layers", 2), ("pager, budget half", args.layers // 2), ("pager, fits all", None)]
        if wname.startswith("compute"):
            budgets = [("pager, budget 2 layers", 2)]
        for label, k in budgets:
            budget = (k * per_layer + slack) if k else 20 * GiB
            # Wrapped at the budget, as a user would: large blocks are split
            # into their parts at wrap when the budget calls for it.
            pager.unwrap(paged)
            pager.wrap(paged, budget=budget, device="cuda", budget_covers="pager")  # (gpu_model beside it)
            parts = sum(b.part for b in pager.of(paged).blocks)
            ms, s = run_pager(paged, x, budget, args.reps)
            moved = s.h2d_bytes
            host_note = ""
            if k is None:
                # A ~6 ms forward: the ratio to all-on-GPU is taken from turns
                # of the two, so that drift between measurements cancels.
                def paged_fwd():
                    with torch.no_grad():
                        paged(x)

                (ref_ms, ref_host), (ms, host) = interleaved_ms([gpu_fwd, paged_fwd])
                ref_name = "all on GPU (interleaved runs)"
                host_note = f", host enqueue {host:.1f} ms vs {ref_host:.1f} ms all on GPU"
            elif wname.startswith("compute"):
                ref_ms, ref_name = gpu_ms, "all on GPU"
            elif k == 2:
                ref_ms, ref_name = moved / (bw * 1e9) * 1e3, "PCIe floor of bytes streamed"
            else:
                must = (args.layers - k) * per_layer
                ref_ms, ref_name = must / (bw * 1e9) * 1e3, f"floor: {args.layers - k} layers must move"
            peak = peak_during(lambda: paged(x))
            rows.append(Row(
                wname, label, ms, peak, ms / ref_ms, ref_name,
                f"moved {moved / 1e9:.2f} GB/fwd, {moved / (ms / 1e3) / 1e9:.1f} GB/s, hits {s.hits} misses {s.misses}"
                + (f"; layers split into {parts} parts" if parts else "") + host_note,
                {"h2d_bytes": moved, "budget": budget, "stall_s": s.stall_seconds},
            ))
            print(rows[-1])
        free_cuda()
        if not wname.startswith("compute"):
            for row in half_budget_blocks(twins, x, per_layer, slack, bw, args, wname):
                rows.append(row)
                print(row)
            rows.append(fits_all_shared(twins, x, gpu_fwd, wname))
            print(rows[-1])

        for name, model in peers_cpu.items():
            if wname.startswith("compute"):
                continue
            row = run_peer(name, model, x, floor_ms, wname, args.reps)
            rows.append(row)
            print(row)
            free_cuda()
    save(rows, "forward", env)
    return rows


def half_budget_blocks(twins, x, per_layer, slack, bw, args, wname):
    """Half budget, three ways, run in turns (interleaved, so drift hits all
    alike): default blocks (layers split into their parts at wrap), every
    nn.Linear a block, and default blocks in the shared mode (as when another
    Python thread exists: blocks in use stay guarded and the forward's
    operations pass the guard one by one)."""
    k = args.layers // 2
    budget = k * per_layer + slack
    # (the all-on-GPU model beside them on the GPU is the benchmark's: the budget is sized for pager's blocks)
    pager.wrap(twins[0], budget=budget, device="cuda", budget_covers="pager")
    pager.wrap(twins[1], budget=budget, device="cuda", blocks=lambda name, m: isinstance(m, torch.nn.Linear),
               budget_covers="pager")

    def fwd(model):
        def run():
            with torch.no_grad():
                model(x)
        return run

    # The shared mode is sticky per pager: the first two columns are measured
    # first, in turns, then the default-blocks model again, shared, in turns
    # with the Linear one (which stays unshared: its flag is kept off).
    (parts_ms, parts_host), (lin_ms, lin_host) = interleaved_ms([fwd(twins[0]), fwd(twins[1])], reps=15)
    stats = []
    for model in twins:
        pg = pager.of(model)
        pg.reset()
        fwd(model)()
        torch.cuda.synchronize()
        stats.append(pg.stats())
    pager.of(twins[0]).shared_mode = True  # as `note_threads` does when a second thread appears
    (shared_ms, shared_host), (lin2_ms, _h) = interleaved_ms([fwd(twins[0]), fwd(twins[1])], reps=15)
    must = (args.layers - k) * per_layer
    floor = must / (bw * 1e9) * 1e3
    parts = sum(b.part for b in pager.of(twins[0]).blocks)
    rows = []
    for label, ms, host, s in [
        (f"pager, budget half, default blocks (split into {parts} parts), in turns", parts_ms, parts_host, stats[0]),
        ("pager, budget half, blocks=nn.Linear, in turns", lin_ms, lin_host, stats[1]),
    ]:
        rows.append(Row(wname, label, ms, None, ms / floor, f"floor: {args.layers - k} layers must move",
                        f"moved {s.h2d_bytes / 1e9:.2f} GB/fwd, {s.h2d_bytes / (ms / 1e3) / 1e9:.1f} GB/s; "
                        f"host enqueue {host:.1f} ms", {"h2d_bytes": s.h2d_bytes, "host_ms": host}))
    rows.append(Row(wname, "pager, budget half, default blocks, shared mode (in turns with nn.Linear)", shared_ms,
                    None, shared_ms / floor, f"floor: {args.layers - k} layers must move",
                    f"host enqueue {shared_host:.1f} ms; nn.Linear in the same turns {lin2_ms:.1f} ms",
                    {"host_ms": shared_host}))
    for model in twins:
        pager.unwrap(model)
    return rows


def fits_all_shared(twins, x, gpu_fwd, wname):
    """Everything fits and the pager sleeps: plain, and in the shared mode
    (a second Python thread: the sleeping pager keeps its guards, so every
    operation on a weight passes one), in turns with all on GPU."""
    for model in twins:
        pager.wrap(model, budget=20 * GiB, device="cuda", budget_covers="pager")  # (gpu_model beside them)
    pager.of(twins[1]).shared_mode = True  # as `note_threads` does when a second thread appears

    def fwd(model):
        def run():
            with torch.no_grad():
                model(x)
        return run

    (gpu_ms, _), (plain_ms, plain_host), (shared_ms, shared_host) = interleaved_ms(
        [gpu_fwd, fwd(twins[0]), fwd(twins[1])])
    for model in twins:
        pager.unwrap(model)
    return Row(wname, "pager, fits all, shared mode (in turns with all on GPU and plain pager)", shared_ms, None,
               shared_ms / gpu_ms, "all on GPU (same turns)",
               f"host enqueue {shared_host:.1f} ms; plain pager {plain_ms:.2f} ms ({plain_ms / gpu_ms:.2f}x), "
               f"all on GPU {gpu_ms:.2f} ms")


def run_peer(name, model, x, floor_ms, wname, reps):
    if name == "accelerate":
        try:
            from accelerate import cpu_offload
        except ImportError:
            return Row(wname, "accelerate cpu_offload", None, note="skipped: accelerate not installed")
        cpu_offload(model, execution_device=torch.device("cuda", 0))

        def fwd():
            with torch.no_grad():
                model(x)

        ms = time_ms(fwd, warmup=1, reps=min(reps, 3))
        return Row(wname, "accelerate cpu_offload", ms, None, ms / floor_ms, "PCIe floor")
    if name == "to_loop":
        def fwd():
            h = x
            with torch.no_grad():
                for layer in model.layers:
                    layer.to("cuda")
                    h = layer(h)
                    layer.to("cpu")
                model.norm.to("cuda")(h)

        ms = time_ms(fwd, warmup=1, reps=2)
        return Row(wname, ".to() loop (pageable)", ms, None, ms / floor_ms, "PCIe floor")
    return Row(wname, name, None, note="skipped: unknown peer")


if __name__ == "__main__":
    main()
