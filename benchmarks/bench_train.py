"""Training steps under a budget.

1. A ~1B-parameter fp32 decoder, AdamW, 4x1024 tokens: all-on-GPU, pager at a
   budget of 40% of the all-on-GPU peak with activations kept, offloaded,
   recomputed (pager's, and the model's own gradient checkpointing) and
   "auto", the same at smaller budgets, and the installed peers (torchao
   CPUOffloadOptimizer, FSDP2 CPUOffloadPolicy, DeepSpeed ZeRO-3 offload).
2. A ProxylessNAS-style supernet (24 layers, a fixed attention and 4
   feed-forward candidates each), one sampled path per step: pager with
   `expect()` vs fully resident.

    python -m benchmarks.bench_train [--only decoder|supernet] [--reps 5] [--offload-budgets 6 4]
    python -m benchmarks.bench_train --only sweep [--shares 0.25 0.4 0.6 0.8 1.0] [--policies offload recompute]
        [--profile-share 1.0]   # torch.profiler traces: python -m benchmarks.profile_summary $OUT/train_profile_*.json.gz

3. (--only sweep) The 1B step against the budget, which then bounds blocks
   and activations together, from 25% to 100% of weights + grads + AdamW
   state, beside all on GPU and the peers.
4. (--only resident) Models that fit their budget, from host-bound (a small
   MLP, a small decoder) to GPU-bound: the bare model's step against the
   wrapped one's, in turns in one process ([Note: asleep] in model/asleep.py:
   from its second step on, a resident model trains without block hooks).

    python -m benchmarks.bench_train --only resident [--reps 5]
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

import pager
from benchmarks.harness import (GiB, Row, environment, free_cuda, host_rss_gib, out_path, pinned_h2d_gbps, profiled,
                                save, time_ms)
from benchmarks.models import Decoder, SuperNet

VOCAB = 32000
LABELS = {"offload": ", activations offloaded", "recompute": ", activations recomputed",
          "checkpoint": ", the model's gradient checkpointing", "auto": ", activations auto"}
LONG_RUN_STEPS = 20  # extra steps before reading the allocator's reserved bytes again
AUTO_MAX_TRIAL_STEPS = 12  # steps run before timing while activations="auto" has not chosen


def decoder_1b(device):
    with torch.device(device):
        return Decoder(n_layers=18, d=2048, ff=5632, heads=16, vocab=VOCAB)


def cpu_copy(model_factory, gpu_model):
    m = model_factory("meta").to_empty(device="cpu")
    m.load_state_dict(gpu_model.state_dict())
    return m


def make_step(model, opt, ids, tgt):
    def step():
        loss = F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def measure(step, reps, warmed=None):
    """(median ms, peak GiB allocated over the timed steps); `warmed` is
    called after the first two steps (the first pass is outside the budget's
    bound: [Note: one budget])."""
    step()
    step()  # optimizer state exists from here on
    if warmed is not None:
        warmed()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = time_ms(step, warmup=1, reps=reps)
    return ms, torch.cuda.max_memory_allocated() / GiB


def bench_decoder(args, rows):
    w = "1B decoder AdamW step 4x1024"
    ids = torch.randint(0, VOCAB, (4, 1024), device="cuda")
    tgt = torch.randint(0, VOCAB, (4, 1024), device="cuda")
    gpu = decoder_1b("cuda")
    nparams = sum(p.numel() for p in gpu.parameters())
    cpu_ref = cpu_copy(decoder_1b, gpu)
    opt = torch.optim.AdamW(gpu.parameters(), lr=1e-4)
    gpu_ms, gpu_peak = measure(make_step(gpu, opt, ids, tgt), args.reps)
    rows.append(Row(w, f"all on GPU ({nparams / 1e6:.0f}M params)", gpu_ms, gpu_peak, 1.0, "itself"))
    print(rows[-1])
    del gpu, opt
    free_cuda()

    budget = int(0.4 * gpu_peak * GiB)
    configs = [(budget, True, "keep"), (budget, False, "keep")]
    for b in [budget / GiB, *args.offload_budgets]:
        configs += [(int(b * GiB), True, a) for a in ("offload", "recompute", "checkpoint", "auto")]
    for budget, defer, activations in configs:
        model = copy.deepcopy(cpu_ref)
        # "checkpoint": the model's own gradient checkpointing (torch.utils.checkpoint per layer), under pager.
        model.gradient_checkpointing = activations == "checkpoint"
        pager.wrap(model, budget=budget, device="cuda", defer_step=defer,
                   activations="keep" if activations == "checkpoint" else activations)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        pg = pager.of(model)
        for _ in range(AUTO_MAX_TRIAL_STEPS):  # "auto" tries both policies first: not timed
            if pg.stats().activations_policy != "auto":
                break
            make_step(model, opt, ids, tgt)()
        ms, peak = measure(make_step(model, opt, ids, tgt), args.reps)
        pg.reset()
        make_step(model, opt, ids, tgt)()
        s = pg.stats()
        # Fragmentation: what the caching allocator holds against what is in
        # use, after the timed steps and again after a longer run.
        reserved = [torch.cuda.memory_reserved() / GiB]
        for _ in range(LONG_RUN_STEPS):
            make_step(model, opt, ids, tgt)()
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved() / GiB)
        acts = (f"; activations offloaded: {s.activations_sent_bytes / 1e9:.1f} GB out, "
                f"{s.activations_brought_bytes / 1e9:.1f} GB back ({s.activations_ahead_bytes / 1e9:.1f} GB ahead)"
                if s.activations_sent_bytes else "")
        acts += (f"; {s.recomputes} blocks recomputed ({s.activations_recomputed_bytes / 1e9:.1f} GB)"
                 if s.recomputes else "")
        acts += f"; auto chose {s.activations_policy}" if activations == "auto" else ""
        rows.append(Row(
            w, f"pager, budget {budget / GiB:.1f} GiB ({100 * budget / (gpu_peak * GiB):.0f}% of peak)"
            f"{'' if defer else ', defer_step=False'}"
            f"{LABELS.get(activations, '')}",
            ms, peak, ms / gpu_ms, "all on GPU",
            f"per step: {s.h2d_bytes / 1e9:.1f} GB in, {s.d2h_bytes / 1e9:.1f} GB out (blocks){acts}; "
            f"hit {100 * s.hit_rate:.0f}%; "
            f"{s.deferred_steps} block updates deferred; allocator reserved {reserved[0]:.2f} GiB after "
            f"{args.reps + 4} steps, {reserved[1]:.2f} GiB after {args.reps + 4 + LONG_RUN_STEPS}",
            {"h2d": s.h2d_bytes, "d2h": s.d2h_bytes, "stall_s": s.stall_seconds, "reserved_gib": reserved},
        ))
        print(rows[-1])
        pager.unwrap(model)
        del model, opt
        free_cuda()

    for peer in filter(None, args.peers.split(",")):
        rows.append(run_peer(peer, cpu_ref, ids, tgt, gpu_ms, args.reps, w))
        print(rows[-1])


def peer_torchao(cpu_ref, ids, tgt, gpu_ms, reps, w):
    from torchao.optim import CPUOffloadOptimizer

    model = copy.deepcopy(cpu_ref).cuda()
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, fused=True)
    ms, peak = measure(make_step(model, opt, ids, tgt), reps)
    return Row(w, "torchao CPUOffloadOptimizer", ms, peak, ms / gpu_ms, "all on GPU")


def fsdp2_sharded(model, offload: bool = True):
    """`model` (its layers, then itself) under FSDP2 in the process group
    there is, with CPUOffloadPolicy if `offload` (else moved to the GPU)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    if not offload:
        model.cuda()
    for layer in model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    return model


def peer_fsdp2(cpu_ref, ids, tgt, gpu_ms, reps, w):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    model = fsdp2_sharded(copy.deepcopy(cpu_ref))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ms, peak = measure(make_step(model, opt, ids, tgt), reps)
    return Row(w, "FSDP2 CPUOffloadPolicy", ms, peak, ms / gpu_ms, "all on GPU")


def deepspeed_zero3_step(model, ids, tgt):
    """A training step of `model` under DeepSpeed ZeRO-3 with parameters and
    AdamW offloaded to the CPU (its CPU Adam builds at first use); in a
    process group of torchrun's, or of one process (RANK, WORLD_SIZE, ... set)."""
    import deepspeed

    cfg = {
        "train_micro_batch_size_per_gpu": ids.shape[0],
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step():
        loss = F.cross_entropy(engine(ids).flatten(0, 1), tgt.flatten())
        engine.backward(loss)
        engine.step()
    return step


def peer_deepspeed(cpu_ref, ids, tgt, gpu_ms, reps, w):
    step = deepspeed_zero3_step(copy.deepcopy(cpu_ref), ids, tgt)
    ms, peak = measure(step, reps)
    return Row(w, "DeepSpeed ZeRO-3 offload", ms, peak, ms / gpu_ms, "all on GPU")


PEERS = {"torchao": peer_torchao, "fsdp2": peer_fsdp2, "deepspeed": peer_deepspeed}


def bench_train_sweep(args, rows):
    """The 1B step against the budget, the budget being the whole of what
    pager holds ([Note: one budget]: blocks and activations), as a share of
    weights + gradients + AdamW state; all on GPU and the installed peers in
    the same run. Peak: the allocator's, over the timed steps."""
    w = "1B decoder AdamW step 4x1024, budget sweep"
    ids = torch.randint(0, VOCAB, (4, 1024), device="cuda")
    tgt = torch.randint(0, VOCAB, (4, 1024), device="cuda")
    gpu = decoder_1b("cuda")
    state_bytes = 16 * sum(p.numel() for p in gpu.parameters())  # fp32 weights, grads, AdamW's two states
    cpu_ref = cpu_copy(decoder_1b, gpu)
    opt = torch.optim.AdamW(gpu.parameters(), lr=1e-4)
    gpu_step = make_step(gpu, opt, ids, tgt)
    gpu_ms, gpu_peak = measure(gpu_step, args.reps)
    rows.append(Row(w, f"all on GPU (weights+grads+AdamW {state_bytes / GiB:.1f} GiB)", gpu_ms, gpu_peak, 1.0,
                    "itself"))
    print(rows[-1])
    if args.profile_share is not None:
        profiled(gpu_step, out_path("train_profile_bare.json.gz"))
    del gpu_step
    del gpu, opt
    free_cuda()
    for share, activations, placement, covers in ((s, a, p, c) for s in args.shares for a in args.policies
                                                  for p in args.placements for c in args.covers):
        budget = int(share * state_bytes)
        model = copy.deepcopy(cpu_ref)
        pager.wrap(model, budget=budget, device="cuda", activations=activations, optimizer_step=placement,
                   budget_covers=covers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        pg = pager.of(model)
        step = make_step(model, opt, ids, tgt)
        for _ in range(AUTO_MAX_TRIAL_STEPS if activations == "auto" else 0):
            if pg.stats().activations_policy != "auto":
                break
            step()
        ms, peak = measure(step, args.reps, warmed=pg.reset)
        s = pg.stats()
        rows.append(Row(
            w, f"pager, budget {budget / GiB:.1f} GiB ({100 * share:.0f}%), activations {activations}"
            + (f" ({s.activations_kept_blocks} blocks kept, the rest {s.activations_policy})"
               if activations == "auto" and s.activations_policy != "keep" else
               " (all kept)" if activations == "auto" else "") + f", optimizer_step={placement}"
            + (f", budget_covers={covers}" if covers != "process" else ""),
            ms, peak, ms / gpu_ms, "all on GPU",
            f"allocator peak {peak / (budget / GiB):.2f}x the budget; outside pager "
            f"{s.outside_bytes / GiB:.2f} GiB (learned); pager's own peak "
            f"{s.peak_device_bytes / GiB:.2f} GiB (activations {s.peak_activation_bytes / GiB:.2f} GiB at most, "
            f"{s.activation_reserve_bytes / GiB:.2f} GiB of the budget set aside); per step "
            f"{s.h2d_bytes / 1e9 / (args.reps + 1):.1f} GB in, {s.d2h_bytes / 1e9 / (args.reps + 1):.1f} GB out "
            f"(blocks), activations {s.activations_sent_bytes / 1e9 / (args.reps + 1):.1f} GB out, "
            f"{s.activations_reused_bytes / 1e9 / (args.reps + 1):.1f} GB of them used where they still were; "
            f"{s.host_steps / (args.reps + 1):.0f} block updates on the host per step "
            f"({1e3 * s.host_step_seconds / (args.reps + 1):.0f} ms of the host's, fetches waited "
            f"{1e3 * s.host_step_wait_seconds / (args.reps + 1):.1f} ms), "
            f"{s.deferred_steps / (args.reps + 1):.0f} deferred; host RSS {host_rss_gib():.1f} GiB",
            {"budget": budget, "share": share, "placement": placement, "peak_device": s.peak_device_bytes,
             "covers": covers, "outside": s.outside_bytes,
             "reserve": s.activation_reserve_bytes, "h2d": s.h2d_bytes, "d2h": s.d2h_bytes,
             "reused": s.activations_reused_bytes,
             "host_steps": s.host_steps, "host_step_s": s.host_step_seconds,
             "host_wait_s": s.host_step_wait_seconds, "activations": activations,
             "chosen": s.activations_policy, "kept_blocks": s.activations_kept_blocks},
        ))
        print(rows[-1])
        first = activations == args.policies[0] and placement == args.placements[0] and covers == args.covers[0]
        if args.profile_share == share and first:
            profiled(step, out_path(f"train_profile_{share:g}.json.gz"))
        if args.trace_share == share and first:
            pg.start_trace(steps=2)  # where the time goes: fetches, write-backs, waits, computes
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            pg.trace(out_path("train_trace.json"))
        pager.unwrap(model)
        del model, opt, step
        free_cuda()
    # Peers last: one leaves memory allocated after it is gone (torchao's
    # optimizer: 3.9 GiB on an H100), which would count in the peaks after it.
    for peer in filter(None, args.peers.split(",")):
        rows.append(run_peer(peer, cpu_ref, ids, tgt, gpu_ms, args.reps, w))
        print(rows[-1])


def run_peer(peer, cpu_ref, ids, tgt, gpu_ms, reps, w):
    """A peer's row; one that is not installed, or fails, says so (and hides no other)."""
    try:
        return PEERS[peer](cpu_ref, ids, tgt, gpu_ms, reps, w)
    except ImportError as e:
        return Row(w, peer, None, note=f"skipped: not installed ({e.name})")
    except Exception as e:  # noqa: BLE001 - a peer failing must not hide the others
        return Row(w, peer, None, note=f"failed: {type(e).__name__}: {str(e)[:120]}")
    finally:
        free_cuda()


def bench_supernet(args, rows):
    w = "NAS supernet step (24 layers x 4 candidates), one path, 8x1024"
    torch.manual_seed(0)
    gpu = SuperNet().cuda()
    ids = torch.randint(0, VOCAB, (8, 1024), device="cuda")
    tgt = torch.randint(0, VOCAB, (8, 1024), device="cuda")
    cpu_ref = copy.deepcopy(gpu).cpu()
    total = sum(p.numel() for p in gpu.parameters()) * 4
    gen = torch.Generator().manual_seed(0)
    paths = [torch.randint(0, 4, (24,), generator=gen).tolist() for _ in range(64)]

    def stepper(model, opt, paged):
        it = iter(paths * 4)

        def step():
            path = next(it)
            model.set_path(path)
            if paged:
                pager.of(model).expect(model.path_modules(path))
            F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten()).backward()
            opt.step()
            opt.zero_grad()

        return step

    opt = torch.optim.Adam(gpu.parameters(), lr=1e-4)
    warm = stepper(gpu, opt, False)
    for _ in range(8):  # every candidate gets its state
        warm()
    gpu_ms = time_ms(warm, warmup=1, reps=args.reps * 2)
    rows.append(Row(w, f"fully resident ({total / GiB:.1f} GiB weights, {4 * total / GiB:.1f} GiB with grads+Adam)",
                    gpu_ms, torch.cuda.max_memory_allocated() / GiB, 1.0, "itself"))
    print(rows[-1])
    del gpu, opt, warm  # the closure holds the resident model too
    free_cuda()

    budget = int(0.25 * 3 * total)  # a quarter of weights + Adam state
    # (updates deferred to the next use on the device, then where the bytes
    # are; activations beside the budget, then under it)
    for placement, activations in (("device", "keep"), ("auto", "keep"), ("auto", "auto")):
        model = copy.deepcopy(cpu_ref)
        pager.wrap(model, budget=budget, device="cuda", optimizer_step=placement, activations=activations)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        step = stepper(model, opt, True)
        pg = pager.of(model)
        for i in range(AUTO_MAX_TRIAL_STEPS):  # (every candidate gets its state; "auto" chooses)
            if i >= 8 and pg.stats().activations_policy != "auto":
                break
            step()
        pg.reset()
        torch.cuda.reset_peak_memory_stats()
        ms = time_ms(step, warmup=1, reps=args.reps * 2)
        s = pg.stats()
        steps = 1 + args.reps * 2
        rows.append(Row(
            w, f"pager, budget 1/4 of weights+Adam ({budget / GiB:.1f} GiB), optimizer_step={placement}, "
            f"activations={activations}" + (f" ({s.activations_policy})" if activations == "auto" else ""), ms,
            torch.cuda.max_memory_allocated() / GiB, ms / gpu_ms, "fully resident",
            f"hit {100 * s.hit_rate:.0f}%, {s.h2d_bytes / steps / 1e9:.2f} GB in / {s.d2h_bytes / steps / 1e9:.2f} GB "
            f"out per step; {s.deferred_steps / steps:.0f} block updates deferred, {s.host_steps / steps:.0f} on "
            f"the host per step; pager's own peak {s.peak_device_bytes / GiB:.2f} GiB",
        ))
        print(rows[-1])
        pager.unwrap(model)
        del model, opt
        free_cuda()


def _resident_shapes():
    """(name, model factory, input, target factory): from host-bound to GPU-bound."""
    import torch.nn as nn

    def mlp():
        return nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))

    return [
        ("MLP 128-1024-1024-1, batch 1024", mlp, lambda: torch.randn(1024, 128, device="cuda"), None),
        ("decoder 8 layers d=256, 8x128 tokens", lambda: Decoder(n_layers=8, d=256, ff=704, heads=4, vocab=VOCAB),
         lambda: torch.randint(0, VOCAB, (8, 128), device="cuda"), True),
        ("decoder 12 layers d=1024, 4x512 tokens", lambda: Decoder(n_layers=12, d=1024, ff=2816, heads=8, vocab=VOCAB),
         lambda: torch.randint(0, VOCAB, (4, 512), device="cuda"), True),
    ]


def bench_resident(args, rows):
    from benchmarks.harness import interleaved_ms

    for name, factory, make_input, lm in _resident_shapes():
        torch.manual_seed(0)
        bare = factory().cuda()
        wrapped = copy.deepcopy(bare)
        # (the bare model beside it on the GPU is the benchmark's: the budget is sized for pager's blocks)
        pager.wrap(wrapped, budget="40GiB", device="cuda", budget_covers="pager")
        x = make_input()

        def stepper(model):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            if lm:
                return make_step(model, opt, x, x)

            def step():
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()

            return step

        steps = [stepper(bare), stepper(wrapped)]
        for step in steps:
            step()  # the first step makes the gradients' pages and the optimizer state
        pg = pager.of(wrapped)
        pg.reset()
        (bare_ms, bare_host), (ms, host) = interleaved_ms(steps, warmup=3, reps=20 * args.reps)
        s = pg.stats()
        rows.append(Row(f"training step, {name}, AdamW", "bare model", bare_ms, ratio=1.0, reference="itself",
                        note=f"host {bare_host:.2f} ms"))
        rows.append(Row(f"training step, {name}, AdamW", "pager, budget 40 GiB (fits)", ms, ratio=ms / bare_ms,
                        reference="bare model",
                        note=f"host {host:.2f} ms; {s.resident_forwards} of {s.steps} forwards ran without block hooks"))
        print(rows[-2], rows[-1], sep="\n")
        pager.unwrap(wrapped)
        del bare, wrapped, steps
        free_cuda()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["decoder", "supernet", "sweep", "resident"])
    ap.add_argument("--shares", type=float, nargs="*", default=[0.25, 0.4, 0.6, 0.8, 1.0],
                    help="sweep: budgets as shares of weights + grads + AdamW state")
    ap.add_argument("--policies", nargs="*", default=["offload", "recompute"], help="sweep: activations=")
    ap.add_argument("--placements", nargs="*", default=["auto", "device"], help="sweep: optimizer_step=")
    ap.add_argument("--covers", nargs="*", default=["process"], help="sweep: budget_covers= (default: the process, wrap's default)")
    ap.add_argument("--trace-share", type=float, default=None,
                    help="sweep: write a trace of two steps at this share (first policy and placement)")
    ap.add_argument("--profile-share", type=float, default=None,
                    help="sweep: torch.profiler traces of two steps at this share (first policy and placement) and "
                         "of the bare model (benchmarks.profile_summary reads them)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--peers", default="torchao,fsdp2,deepspeed")
    ap.add_argument("--offload-budgets", type=float, nargs="*", default=[6.0],
                    help="extra budgets (GiB) run with activations offloaded, recomputed, checkpointed and auto")
    args = ap.parse_args(argv)
    env = environment()
    env["pinned_h2d_GBps"] = round(pinned_h2d_gbps(), 1)
    rows: list[Row] = []
    if args.only in (None, "decoder"):
        bench_decoder(args, rows)
    if args.only in (None, "supernet"):
        bench_supernet(args, rows)
    if args.only == "sweep":
        bench_train_sweep(args, rows)
    if args.only == "resident":
        bench_resident(args, rows)
    save(rows, {"sweep": "train_sweep", "resident": "train_resident"}.get(args.only, "train"), env)


if __name__ == "__main__":
    main()
