"""Models larger than host RAM: a 7B-shaped bf16 decoder paged from its
checkpoint files on disk (`pager.load` with a host budget), against the
disk's sequential read rate measured by a plain tool (dd, O_DIRECT) in the
same run, and accelerate's disk offload.

    python -m benchmarks.bench_disk [--layers 16] [--tokens 512] [--dir PATH] [--host-share 0.25]

The checkpoint is written as sharded safetensors under --dir (on the disk to
measure; 6.5 GB for 16 layers) and dropped from the page cache before each
measurement, so that every read comes from the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time

import torch

import pager
from benchmarks.harness import Row, environment, free_cuda, save, time_ms
from benchmarks.models import Decoder, build, layer_bytes
from pager.base.files import header_for


def write_checkpoint(model, folder: str, layers_per_shard: int = 2) -> int:
    """Sharded safetensors of `model` (a shard per `layers_per_shard` layers);
    returns the bytes written. Each shard is fsync'd and dropped from the page cache."""
    os.makedirs(folder, exist_ok=True)
    names = list(model.state_dict())
    shards, weight_map, total = {}, {}, 0
    for name in names:
        layer = int(name.split(".")[1]) // layers_per_shard if name.startswith("layers.") else -1
        shards.setdefault(layer, []).append(name)
    state = model.state_dict()
    for i, (key, shard) in enumerate(sorted(shards.items())):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, _ = header_for([(n, state[n].dtype, tuple(state[n].shape)) for n in shard])
        with open(os.path.join(folder, file), "wb") as f:
            f.write(header)
            for n in shard:
                t = state[n].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(t.numpy()))
                total += t.numel()
            f.flush()
            os.fsync(f.fileno())
        weight_map.update({n: file for n in shard})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    drop_cache(folder)
    return total


def drop_cache(folder: str) -> None:
    """Drop the folder's files from the page cache (clean pages: no root needed)."""
    for root, _dirs, files in os.walk(folder):
        for file in files:
            fd = os.open(os.path.join(root, file), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dd_gbps(folder: str, streams: int = 1, direct: bool = True) -> float:
    """Sequential read rate of the folder's shards by dd (O_DIRECT, or through
    the page cache with the kernel's read ahead), in `streams` dd processes
    at once (each reading its share of the shards)."""
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    drop_cache(folder)
    flag = "iflag=direct" if direct else ""
    cmds = [" ; ".join(f"dd if={p} of=/dev/null bs=64M {flag} 2>/dev/null" for p in files[i::streams])
            for i in range(streams)]
    t0 = time.perf_counter()
    for proc in [subprocess.Popen(["bash", "-c", c]) for c in cmds]:
        if proc.wait():
            raise RuntimeError("dd failed")
    return sum(os.path.getsize(p) for p in files) / (time.perf_counter() - t0) / 1e9


def fio_gbps(folder: str) -> float | None:
    """Sequential read rate by fio (libaio, O_DIRECT, 16 MiB requests, 16 in flight), if installed."""
    if shutil.which("fio") is None:
        return None
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    drop_cache(folder)
    out = subprocess.run(["fio", "--name=seq", "--rw=read", "--bs=16M", "--iodepth=16", "--ioengine=libaio",
                          "--direct=1", "--readonly", "--output-format=json", "--filename=" + ":".join(files)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["jobs"][0]["read"]["bw_bytes"] / 1e9


def meta_model(layers: int) -> Decoder:
    with torch.device("meta"):
        return Decoder(n_layers=layers).to(torch.bfloat16)


def run_pager(folder, layers, x, budget, host_budget, reps, spill):
    drop_cache(folder)
    model = pager.load(meta_model(layers), folder, budget=budget, host_budget=host_budget, spill=spill)
    pg = pager.of(model)

    def fwd():
        with torch.no_grad():
            model(x)

    fwd()  # learn the order
    pg.reset()
    ms = time_ms(fwd, warmup=1, reps=reps)
    torch.cuda.synchronize()
    s = pg.stats()
    s.device_kept_bytes = sum(b.nbytes() for b in pg.all_blocks() if b in pg.scheduler.kept or b.resident_for_life)
    pager.unwrap(model)  # (its weights come back to host memory as plain tensors, then go with the model)
    return ms, s


def first_forward(folder, layers, x, budget):
    """Seconds from `pager.load` to the first forward's output, with every
    page read into host memory in the background; and until all are read."""
    drop_cache(folder)
    t0 = time.perf_counter()
    model = pager.load(meta_model(layers), folder, budget=budget)
    loaded = time.perf_counter() - t0
    started = []
    model.layers[0].register_forward_pre_hook(lambda *a: started.append(time.perf_counter() - t0))
    with torch.no_grad():
        model(x)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    disk = pager.of(model).engine.host.disks[pager.of(model)]
    for read in list(disk.reading.values()):
        read.result()
    everything = time.perf_counter() - t0
    s = pager.of(model).stats()
    pager.unwrap(model)
    return loaded, started[0], first, everything, s


def run_accelerate(cpu_model, x, folder, reps):
    try:
        from accelerate import disk_offload
    except ImportError:
        return None, "accelerate not installed"
    offload = os.path.join(folder, "accelerate")
    disk_offload(cpu_model, offload, execution_device=0)
    os.sync()

    def fwd():
        drop_cache(offload)  # every forward reads from the disk, as pager's do
        with torch.no_grad():
            cpu_model(x)

    return time_ms(fwd, warmup=1, reps=reps), ""


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=".bench_disk")
    ap.add_argument("--host-share", type=float, default=0.25, help="host budget as a share of the model")
    ap.add_argument("--budget-layers", type=float, default=3.0, help="device budget in layers")
    ap.add_argument("--peers", default="accelerate")
    args = ap.parse_args(argv)
    env = environment()
    folder = os.path.abspath(args.dir)
    shutil.rmtree(folder, ignore_errors=True)
    gpu_model = build("cuda", n_layers=args.layers).eval()
    per_layer = layer_bytes(gpu_model)
    total = per_layer * args.layers
    t0 = time.perf_counter()
    written = write_checkpoint(gpu_model, os.path.join(folder, "ckpt"))
    write_s = time.perf_counter() - t0
    ckpt = os.path.join(folder, "ckpt")
    rates = {f"dd direct x{n}": dd_gbps(ckpt, n) for n in (1, 4, 8)}
    rates.update({f"dd buffered x{n}": dd_gbps(ckpt, n, direct=False) for n in (1, 4)})
    fio = fio_gbps(ckpt)
    if fio is not None:
        rates["fio libaio qd16"] = fio
    seq = max(rates.values())  # the disk's peak: the best plain tool (pager's own rate joins below)
    env["disk_seq_read_GBps"] = {n: round(r, 2) for n, r in rates.items()}
    env["checkpoint_write_GBps"] = round(written / write_s / 1e9, 2)
    print(f"checkpoint {written / 1e9:.2f} GB written at {written / write_s / 1e9:.2f} GB/s; sequential reads: "
          + ", ".join(f"{n}: {r:.2f} GB/s" for n, r in rates.items()))
    x = torch.randn(1, args.tokens, 4096, device="cuda", dtype=torch.bfloat16)
    work = f"7B-shape fwd 1x{args.tokens}, {args.layers} layers ({total / 1e9:.1f} GB)"
    rows = []
    gpu_ms = time_ms(lambda: gpu_model(x), warmup=2, reps=5)
    rows.append(Row(work, "all on GPU", gpu_ms))
    cpu_model = None
    if "accelerate" in args.peers:
        cpu_model = build("cpu", n_layers=args.layers).eval()
        cpu_model.load_state_dict({k: v.cpu() for k, v in gpu_model.state_dict().items()})
    del gpu_model
    free_cuda()
    budget = int(args.budget_layers * per_layer) + (64 << 20)

    # Every page read once into host memory, in the background: when does the first output come?
    loaded, started, first, everything, s = first_forward(ckpt, args.layers, x, budget)
    if s.disk_read_gbps > seq:  # pager's reads beat every plain tool here: its rate is the peak for the floors
        env["disk_peak_from"] = "pager's own reads of the whole model"
        seq = s.disk_read_gbps
    env["disk_peak_GBps"] = round(seq, 2)
    rows.append(Row(work, "pager.load, first forward (host_budget=None)", first * 1e3,
                    note=f"load returned at {loaded:.2f} s, the first layer ran at {started:.2f} s, the forward "
                         f"ended at {first:.2f} s; all {s.disk_read_bytes / 1e9:.2f} GB read at "
                         f"{everything:.2f} s ({s.disk_read_gbps:.2f} GB/s while reading, "
                         f"{100 * s.disk_read_gbps / max(rates.values()):.0f}% of the best plain tool)",
                    extra=dict(load_s=loaded, first_layer_s=started, first_s=first, all_read_s=everything, read_gbps=s.disk_read_gbps)))
    free_cuda()

    for share in sorted({args.host_share, 0.5, 0.15}):
        host_budget = int(share * total)
        ms, s = run_pager(ckpt, args.layers, x, budget, host_budget, args.reps, os.path.join(folder, "spill"))
        per_fwd = s.disk_read_bytes / max(1, args.reps + 1)
        # What must come from disk on every pass: the model less what host memory and the device keep.
        must = max(0, total - host_budget - s.device_kept_bytes)
        floor_ms = must / (seq * 1e9) * 1e3
        rows.append(Row(work, f"pager, host budget {share:.0%} of the model", ms, ratio=ms / floor_ms,
                        reference=f"disk floor {floor_ms:.0f} ms ({must / 1e9:.2f} GB / the peak)",
                        note=f"{per_fwd / 1e9:.2f} GB from disk per forward ({100 * s.disk_direct_bytes / max(1, s.disk_read_bytes):.0f}% "
                             f"direct) at {s.disk_read_gbps:.2f} GB/s ({100 * s.disk_read_gbps / seq:.0f}% of the peak); "
                             f"{s.host_hits} host hits, {s.host_misses} waits",
                        extra=dict(floor_ms=floor_ms, must_bytes=must, disk_bytes_per_fwd=per_fwd,
                                   read_gbps=s.disk_read_gbps, host_hits=s.host_hits, host_misses=s.host_misses)))
        print(rows[-1])
        free_cuda()

    if cpu_model is not None:
        ms, why = run_accelerate(cpu_model, x, folder, max(1, args.reps - 1))
        floor_all = total / (seq * 1e9) * 1e3
        rows.append(Row(work, "accelerate disk_offload (every weight from disk)", ms,
                        ratio=ms / floor_all if ms else None, reference=f"its floor {floor_all:.0f} ms (model / the peak)",
                        note=why or "page cache dropped before each forward"))
    save(rows, "bench_disk", env)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
