"""What the machine says: the link's copy rate, device memory and use, host RAM."""

from __future__ import annotations

import time

import psutil
import torch

from ..base.budget import format_bytes

LINK_PROBE_BYTES = 256 << 20
ASSUMED_LINK_GBPS = 55.0  # PCIe Gen5 x16 from pinned memory, measured on an H100 host
MATMUL_PROBE_SIZE = 2048  # (three 2048-square matrices: 48 MiB in float32)
PROBED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # (`measure_matmul_flops`'s)


def measure_link_gbps(device: torch.device, pinned: bool, transport=None) -> float:
    """Host-to-device GB/s for one large copy (best of 3); through
    `transport`'s fetch path if given (over its helpers' links too where it
    splits fetches: [Note: split fetch] in engine/split_fetch.py)."""
    host = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, pin_memory=pinned and device.type == "cuda")
    dev = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        if device.type != "cuda":
            t0 = time.perf_counter()
            dev.copy_(host)
            best = min(best, time.perf_counter() - t0)
            continue
        if transport is not None:
            start, end = transport.h2d(dev, host)
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dev.copy_(host, non_blocking=True)
            end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    if transport is not None and device.type == "cuda":
        torch.cuda.synchronize(device)  # (the probe's memory is freed on return: every copy into it is done)
    return LINK_PROBE_BYTES / best / 1e9


_MATMUL_FLOPS: dict = {}  # (device, dtype, torch's matmul precision) -> FLOP/s, measured once a process


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = MATMUL_PROBE_SIZE) -> float:
    """FLOP/s of an `n`-square matmul in `dtype` (one of `PROBED_DTYPES`) on
    the CUDA `device` (best of 3 runs of 4, under torch's matmul settings
    now: TF32 or not), once a process for each."""
    key = (device, dtype, torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32)
    if key not in _MATMUL_FLOPS:
        a = torch.full((n, n), 0.5, device=device, dtype=dtype)  # (no random numbers: the user's generator stays)
        b, out = torch.full_like(a, 0.25), torch.empty_like(a)
        torch.mm(a, b, out=out)  # (the kernel chosen and loaded: not timed)
        best = float("inf")
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(4):
                torch.mm(a, b, out=out)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / 4)
        _MATMUL_FLOPS[key] = 2 * n**3 / best
    return _MATMUL_FLOPS[key]


def measure_peer_gbps(helper: torch.device, device: torch.device) -> float:
    """GB/s of one large copy from `helper`'s memory into `device`'s over
    their peer link (best of 3): how pages a helper keeps come up ([Note:
    pages kept on helpers] in engine/helper_pages.py)."""
    src = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device=helper)
    dst = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device=device)
    best = float("inf")
    with torch.cuda.device(helper):  # (the copy runs on the source's current stream)
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
    return LINK_PROBE_BYTES / best / 1e9


def system_lines(pager) -> list[str]:
    vm = psutil.virtual_memory()
    lines = [
        f"host: {format_bytes(vm.available)} available of {format_bytes(vm.total)}; "
        f"pager holds {format_bytes(pager.arena.reserved_bytes)} of host pages"
        f" ({'pinned' if pager.arena.pin else 'pageable'}, {format_bytes(pager.arena.used_bytes)} used)"
    ]
    if pager.device.type == "cuda":
        lines.append(_gpu_line(pager.device))
    return lines


def _gpu_line(device: torch.device) -> str:
    allocated = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        nvml = (
            f"{format_bytes(mem.used)} used of {format_bytes(mem.total)}, "
            f"GPU {util.gpu}% busy, memory {util.memory}% busy"
        )
    except Exception as e:  # NVML absent (containers without it): say so
        nvml = f"NVML unavailable ({type(e).__name__})"
    return (
        f"{device}: {nvml}; torch allocated {format_bytes(allocated)}, "
        f"reserved {format_bytes(reserved)} ({format_bytes(reserved - allocated)} cached)"
    )
