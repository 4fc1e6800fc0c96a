"""Parse the user's budget ("10GiB", "60%", "auto", an int) into bytes."""

from __future__ import annotations

import math
import re

import torch

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")

# Room left for activations, the CUDA context and the allocator's slack when
# the budget is "auto".
AUTO_MARGIN_FRACTION = 0.15
AUTO_MARGIN_MIN_BYTES = 1 << 30

_HELP = 'use bytes as an int, a size like "10GiB", "512MiB", "1.5GB", a share like "60%", or "auto"'


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of `device`; host RAM for the CPU device."""
    if device.type == "cuda":
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            # pynvml does not see what this process's caching allocator holds
            # but has not handed out; add it back.
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            return int(info.free) + cached, int(info.total)
        except Exception:  # pynvml missing or NVML unavailable: ask torch
            free, total = torch.cuda.mem_get_info(device)
            return int(free), int(total)
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


class AllocatorCounter:
    """The CUDA caching allocator's counters of one device."""

    def __init__(self, device):
        self.device = device

    def read(self) -> tuple[int, int]:
        """(bytes allocated now, the most allocated since the last reset)."""
        s = torch.cuda.memory_stats(self.device)
        return s.get("allocated_bytes.all.current", 0), s.get("allocated_bytes.all.peak", 0)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def allocator_counter(device: torch.device) -> AllocatorCounter | None:
    """The allocator's counters of `device`, or None where it keeps none (the CPU)."""
    return AllocatorCounter(device) if device.type == "cuda" else None


def parse_budget(budget, device: torch.device, *, host_bound: bool = True) -> int:
    """Return `budget` in bytes for `device`, or raise ValueError naming the fix.

    Args:
        budget: an int (bytes), a size string ("10GiB", "512MiB", "1.5GB"), a
            share of the device's memory ("60%"), or "auto" (free memory less a
            margin for activations).
        device: the device the budget is for.
        host_bound: on the CPU device, refuse a budget above the host's
            memory (False: `plan`, which figures a GPU's budget on a machine
            without one).

    Example:
        >>> parse_budget("1.5KiB", torch.device("cpu"))
        1536
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise ValueError(f"pager: budget={budget!r} is not understood; {_HELP}.")
    if isinstance(budget, int):
        nbytes = budget
    else:
        nbytes = _parse_string(budget, device)
    if nbytes <= 0:
        raise ValueError(f"pager: budget={budget!r} must be more than 0 bytes; {_HELP}.")
    _free, total = device_memory(device)  # (on the CPU device the budget is host memory: psutil's)
    if nbytes > total and (host_bound or device.type == "cuda"):
        if device.type == "cuda":
            raise ValueError(
                f"pager: budget={budget!r} ({format_bytes(nbytes)}) is larger than {device}'s "
                f'{format_bytes(total)}; give at most its size, e.g. budget="90%" or "auto".'
            )
        # (worded for a host budget too: pager.load's host_budget= is parsed here, and its message is this one)
        raise ValueError(
            f"pager: budget={budget!r} ({format_bytes(nbytes)}) is larger than this host's memory "
            f"({format_bytes(total)}); give at most that, e.g. {format_bytes(total // 2)!r}."
        )
    return nbytes


def _parse_string(text: str, device: torch.device) -> int:
    s = text.strip().lower()
    if s == "auto":
        free, _total = device_memory(device)
        margin = max(AUTO_MARGIN_MIN_BYTES, int(free * AUTO_MARGIN_FRACTION))
        if free - margin <= 0:
            raise ValueError(
                f'pager: budget="auto" found only {format_bytes(free)} free on {device}, '
                f"less than the {format_bytes(margin)} kept for activations; free memory on the "
                f"device or give a budget in bytes."
            )
        return free - margin
    if s.endswith("%"):
        try:
            share = float(s[:-1])
        except ValueError:
            raise ValueError(f"pager: budget={text!r} is not understood; {_HELP}.") from None
        if not 0 < share <= 100:
            raise ValueError(f"pager: budget={text!r} is a share of the device's memory and must lie in (0%, 100%].")
        _free, total = device_memory(device)
        return int(total * share / 100)
    m = _PATTERN.match(s)
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(f"pager: budget={text!r} is not understood; {_HELP}.")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def format_bytes(n: float, up: bool = False) -> str:
    """1536 -> '1.50 KiB'. `up`: rounded up, never below `n` (a least budget
    a user may pass back as it reads)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{math.ceil(n) if up else n:.0f} {unit}"
            return f"{math.ceil(n * 100) / 100 if up else n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def resolve_device(device) -> torch.device:
    """`device` checked, as a torch.device; None: the current CUDA device, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f'pager: device={device!r} is not a device; use "cuda", "cuda:0" or "cpu".') from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f'pager: device={device!r} but CUDA is not available here; use device="cpu" '
                f"(the same paging with host memory standing for the GPU) or run on a CUDA machine."
            )
        count = torch.cuda.device_count()
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= count:
            raise ValueError(
                f"pager: device={device!r} but this host has {count} CUDA device(s) (cuda:0..cuda:{count - 1}); "
                f"pass one of them."
            )
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise ValueError(
            f'pager: device={device!r} is not supported: pager runs on CUDA devices and the CPU; use "cuda", '
            f'"cuda:0" or "cpu".'
        )
    if dev.index not in (None, 0):
        raise ValueError(
            f'pager: device={device!r} names a CPU index that pager does not have: the CPU is one device, "cpu" '
            f'(also "cpu:0"); pass device="cpu", or a CUDA device such as "cuda:{dev.index}" for a GPU.'
        )
    # "cpu:0" is "cpu": the device of every CPU tensor, to compare with (a shared engine's, a tensor's).
    return torch.device("cpu")
