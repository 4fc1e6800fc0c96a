"""Shared benchmark harness: timing with CUDA events, pinned bandwidth,
peak memory, and a results table.

Every figure is a median of `reps` runs after `warmup` runs, timed with CUDA
events around the region (the host does not block inside it)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field

import torch

GiB = 1 << 30


@dataclass
class Row:
    workload: str
    method: str
    ms: float | None
    peak_gib: float | None = None
    ratio: float | None = None       # to the row's reference (floor or all-on-GPU)
    reference: str = ""
    note: str = ""
    extra: dict = field(default_factory=dict)


def event_ms(fn, times: int = 1) -> float:
    """ms of `times` calls of `fn()` run back to back, from CUDA events
    around them (waited for at the end)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(times):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_ms(fn, warmup: int = 2, reps: int = 5) -> float:
    """Median wall time of `fn()` in ms, from CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(event_ms(fn) for _ in range(reps))


def interleaved_ms(fns, warmup: int = 3, reps: int = 40) -> list[tuple[float, float]]:
    """(median device ms, median host ms) of each of `fns`, run in turns so
    that clock and thermal drift hit them alike; for ratios of short runs.
    Host ms is the time to enqueue the work: near the device ms, the run is
    bound by the host (Python), not by the GPU."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    device, host = [[] for _ in fns], [[] for _ in fns]
    if not torch.cuda.is_available():  # (the CPU device runs as it is called: its time is the host's)
        for _ in range(reps):
            for i, fn in enumerate(fns):
                t0 = time.perf_counter()
                fn()
                host[i].append((time.perf_counter() - t0) * 1e3)
        return [(statistics.median(h), statistics.median(h)) for h in host]
    torch.cuda.synchronize()
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            host[i].append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            device[i].append(start.elapsed_time(end))
    return [(statistics.median(d), statistics.median(h)) for d, h in zip(device, host)]


def peak_during(fn) -> float:
    """Peak allocated GiB while running `fn()` once (above what was allocated)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GiB


def pinned_h2d_gbps(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Host-to-device GB/s from page-locked memory (the link's practical peak)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ms = time_ms(lambda: dev.copy_(host, non_blocking=True), warmup=2, reps=reps)
    return nbytes / (ms / 1e3) / 1e9


def host_cpu() -> str:
    """The host's CPU model and core count: host time per block use depends on it."""
    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def environment() -> dict:
    def git(*args):
        try:
            return subprocess.check_output(["git", *args], text=True, stderr=subprocess.DEVNULL).strip()
        except Exception:
            return "unknown"

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "host": host_cpu(),
        "torch": torch.__version__,
        "commit": os.environ.get("PAGER_COMMIT") or git("rev-parse", "--short", "HEAD"),
        "date": time.strftime("%Y-%m-%d"),
    }


def table(rows: list[Row]) -> str:
    out = ["| workload | method | ms | ratio | reference | peak GiB | note |", "|---|---|---:|---:|---|---:|---|"]
    for r in rows:
        ms = f"{r.ms:.1f}" if r.ms is not None else "-"
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
        peak = f"{r.peak_gib:.2f}" if r.peak_gib is not None else "-"
        out.append(f"| {r.workload} | {r.method} | {ms} | {ratio} | {r.reference} | {peak} | {r.note} |")
    return "\n".join(out)


def save(rows: list[Row], name: str, env: dict) -> None:
    with open(out_path(f"{name}.json"), "w") as f:
        json.dump({"env": env, "rows": [asdict(r) for r in rows]}, f, indent=1)
    print(f"\n## {name} ({env['device']}; host {env.get('host', '?')}; torch {env['torch']}, commit {env['commit']})\n")
    print(table(rows))


def out_path(name: str) -> str:
    """Where a benchmark writes `name`: `$OUT`, else the current folder."""
    return os.path.join(os.environ.get("OUT") or ".", name)


def profiled(step, path: str) -> None:
    """Two steps of `step` under torch.profiler, written to `path` (a Chrome
    trace, gzipped if it ends in .gz; `python -m benchmarks.profile_summary`
    says where the time went)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def free_cuda() -> None:
    import gc

    gc.collect()
    if not torch.cuda.is_available():
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    host_empty = getattr(torch._C, "_host_emptyCache", None)  # pinned blocks torch's host allocator keeps
    if host_empty is not None:
        host_empty()
    trim_host_heap()


def trim_host_heap() -> None:
    """Give the C heap's free memory back to the OS (glibc keeps freed blocks
    under its mmap threshold, ~32 MiB: one run's freed tensors would count in
    the next run's host RSS)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # (not glibc: nothing to trim)
        pass


def host_rss_gib() -> float:
    """This process's resident host memory."""
    import psutil

    return psutil.Process().memory_info().rss / 2**30
