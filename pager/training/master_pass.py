"""A float32 master's Adam or AdamW update on the host in one pass.

[Note: a master's update in one pass]
Under `master_weights=True`, an update on the host of a bf16 parameter is
three passes over host memory: the gradient converted to float32, torch's
fused AdamW over the master and moments, and the master rounded into the
weights page ([Note: master weights] in training/masters.py). Host memory
is what they wait for. On an H100's 16-core host, one 202M-parameter layer
of Llama-7B's shape took 64-88 ms in three passes, and the fused kernel
alone (given float32 gradients) 34-42 ms. In the 7B-shaped fine-tune these
updates were the step: 24 of them, one after another, were most of its
1.7 s.

Here the three are one loop (master_pass.c): it reads the bf16 gradient,
the master and the two moments once, and writes the moments, the master
and the bf16 weight once, for all the tensors of a block in one call. The
arithmetic is that of torch's fused CPU kernel (`FusedAdamKernel.cpp`, its
vectorized body) in float32, and the rounding torch's round-to-nearest-even,
so the result lands within that kernel's rounding.

Why C through ctypes, and not torch.compile: the same loop compiled by
inductor ran as fast (41 ms for that layer, against 34 ms for the fused
kernel alone), but inductor's CPU kernels run with the GIL held. The
training loop's thread then waited for each of the worker's kernels: the
7B-shaped step went from 1.7 s to 5.7 s. A ctypes call gives up the GIL for
its length, and a block's tensors take one call, so the worker takes the
GIL back once per block. The loop's threads are its own (pthreads, one
part of each tensor per thread, as many threads as torch's setting on the
worker): OpenMP would bring a second runtime into the process beside
torch's.

Where it runs: where the fused CPU kernel would (a CUDA run; on the CPU
device an update is the optimizer's own code, bit for bit), for
`torch.optim.Adam` and `AdamW` with options it computes as torch's kernel
does (not amsgrad, capturable or differentiable), for contiguous bf16
weights and gradients with float32 master and moments. A tensor it does not
take goes the three passes' way.

The loop is built once per process, at the first update that can use it (on
the worker, not in the training loop's thread), by the machine's C compiler
(`$CC`, else `cc`, `gcc` or `clang`), for this machine's CPU, into a
temporary folder (a fraction of a second). It must then match the loop in
torch ops (`adam_pass`) on a probe. Where there is no compiler, the build
fails or the probe differs, pager logs why (a warning) and keeps the three
passes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import torch

log = logging.getLogger("pager")

CLASSES = ("Adam", "AdamW")  # torch.optim classes updated here
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "master_pass.c")
FLAGS = (["-O3", "-march=native"], ["-O3"])  # (the second where the compiler knows no -march=native)
COMMON_FLAGS = ["-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-pthread"]
N_COEF = 9  # `coefficients` per tensor


def adam_pass(grad, master, exp_avg, exp_avg_sq, weight, c):
    """The loop of master_pass.c in torch ops (its reference, and the
    probe's): one update of `master` and its moments from `grad`, in place,
    with `weight` given the master's rounding. `c`: `coefficients`."""
    g = grad.float() * c[8]
    g = g + master * c[3]  # (Adam's weight decay: into the gradient)
    p = master * c[2]  # (AdamW's: on the master)
    m = exp_avg + (g - exp_avg) * c[4] if abs(float(c[4])) < 0.5 else g + (g - exp_avg) * (c[4] - 1)
    v = exp_avg_sq * c[5] + c[6] * g * g
    p = p + (-c[0]) * m / (v.sqrt() / c[1] + c[7])
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    master.copy_(p)
    weight.copy_(p)


def decoupled_decay(optimizer, group: dict) -> bool:
    """Whether the weight decay is AdamW's (on the master), not Adam's (into the gradient)."""
    return type(optimizer).__name__ == "AdamW" or bool(group.get("decoupled_weight_decay", False))


def coefficients(group: dict, step: float, decoupled: bool) -> list:
    """For an update at `step` with `group`'s options: step size, the square
    root of the second bias correction, 1 - lr x weight decay (AdamW, where
    `decoupled`; else 1), weight decay (Adam; else 0), 1 - beta1, beta2,
    1 - beta2, eps, -1 to maximize (else 1). Reckoned in double, as torch's
    kernel does."""
    lr, (beta1, beta2) = float(group["lr"]), map(float, group["betas"])
    decay = float(group.get("weight_decay", 0.0))
    return [
        lr / (1 - beta1**step),
        (1 - beta2**step) ** 0.5,
        1 - lr * decay if decoupled else 1.0,
        0.0 if decoupled else decay,
        1 - beta1,
        beta2,
        1 - beta2,
        float(group["eps"]),
        -1.0 if group.get("maximize") else 1.0,
    ]


class OnePass:
    """master_pass.c's loop, built and loaded once per process."""

    _lock = threading.Lock()
    _kernel = None
    _tried = False

    @classmethod
    def kernel(cls):
        """The loop (a ctypes function), or None where it could not be made."""
        with cls._lock:
            if not cls._tried:
                cls._tried = True
                try:
                    cls._kernel = _checked(_built())
                except Exception as error:  # (no compiler, a failed build, a probe that differs)
                    log.warning(
                        "pager: a float32 master's update on the host in one pass is not available (%s); "
                        "its three passes run instead (slower: [Note: a master's update in one pass])",
                        error,
                    )
            return cls._kernel


def _built():
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler: set CC, or install cc, gcc or clang")
    with tempfile.TemporaryDirectory(prefix="pager-") as folder:
        library = os.path.join(folder, "pager_master_pass.so")
        for flags in FLAGS:
            built = subprocess.run(
                [compiler, *flags, *COMMON_FLAGS, "-o", library, SOURCE], capture_output=True, text=True, timeout=120
            )
            if built.returncode == 0:
                break
        else:
            raise RuntimeError(f"{compiler} could not build {SOURCE}: {built.stderr.strip()[-500:]}")
        kernel = ctypes.CDLL(library).pager_adam_bf16  # (mapped: the file may go)
    pointers = ctypes.POINTER(ctypes.c_void_p)
    kernel.argtypes = [
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_int64),
        pointers,
        pointers,
        pointers,
        pointers,
        pointers,
        ctypes.POINTER(ctypes.c_float),
        ctypes.c_int64,
    ]
    kernel.restype = None
    return kernel


def _checked(kernel):
    """`kernel`, if it computes `adam_pass` on a probe (a size with a ragged tail, both lerp forms)."""
    gen = torch.Generator().manual_seed(0)
    for c1 in (0.1, 0.7):
        n = 1000 + 7
        c = coefficients(
            {"lr": 1e-3, "betas": (1 - c1, 0.999), "weight_decay": 0.01, "eps": 1e-8}, 3.0, decoupled=False
        )
        master = torch.randn(n, generator=gen)
        mine = [
            torch.randn(n, generator=gen).to(torch.bfloat16),
            master,
            torch.randn(n, generator=gen) * 0.1,
            torch.rand(n, generator=gen),
            master.to(torch.bfloat16),
        ]
        expected = [t.clone() for t in mine]
        grad, master_ref, exp_avg, exp_avg_sq, weight = expected
        adam_pass(grad, master_ref, exp_avg, exp_avg_sq, weight, torch.tensor(c, dtype=torch.float32))
        _call(kernel, [mine], [c], threads=3)
        for got, want in zip(mine[1:], expected[1:]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    return kernel


def _call(kernel, tensors: list, coefs: list, threads: int) -> None:
    """`kernel` over `tensors` ((grad, master, exp_avg, exp_avg_sq, weight) each) with their `coefs`."""
    n = len(tensors)
    columns = [(ctypes.c_void_p * n)(*(ts[i].data_ptr() for ts in tensors)) for i in range(5)]
    sizes = (ctypes.c_int64 * n)(*(ts[1].numel() for ts in tensors))
    flat = (ctypes.c_float * (n * N_COEF))(*(x for c in coefs for x in c))
    kernel(n, sizes, *columns, flat, threads)


def takes(optimizer) -> bool:
    """Whether `optimizer`'s class is updated here (torch.optim's Adam or AdamW)."""
    cls = type(optimizer)
    return cls.__module__.split(".")[:2] == ["torch", "optim"] and cls.__name__ in CLASSES


def _fits(group: dict, master, state: dict, grad, weight) -> bool:
    step = state.get("step")
    if (
        group.get("amsgrad")
        or group.get("capturable")
        or group.get("differentiable")
        or not isinstance(step, torch.Tensor)
        or step.numel() != 1
        or not isinstance(state.get("exp_avg"), torch.Tensor)
        or not isinstance(state.get("exp_avg_sq"), torch.Tensor)
    ):
        return False
    tensors = (grad, master, state["exp_avg"], state["exp_avg_sq"], weight)
    dtypes = (torch.bfloat16, torch.float32, torch.float32, torch.float32, torch.bfloat16)
    return all(
        t.device.type == "cpu" and t.is_contiguous() and t.numel() == master.numel() and t.dtype == d
        for t, d in zip(tensors, dtypes)
    )


def update(optimizer, items: list) -> set:
    """The updates by `optimizer`'s class of the masters in `items` ((its
    group, master, state, bf16 gradient, bf16 weight) each) that this pass
    takes, in one call, each weight given its master's rounding and each
    step counted; returns their ids (the others are left as they were)."""
    taken = [item for item in items if _fits(*item)]
    kernel = OnePass.kernel() if taken else None
    if kernel is None:
        return set()
    coefs = [
        coefficients(group, float(state["step"]) + 1, decoupled_decay(optimizer, group))
        for group, _m, state, _g, _w in taken
    ]
    tensors = [
        (grad, master, state["exp_avg"], state["exp_avg_sq"], weight) for _group, master, state, grad, weight in taken
    ]
    _call(kernel, tensors, coefs, torch.get_num_threads())
    for _group, _master, state, _grad, _weight in taken:
        state["step"] += 1  # (in place, as torch's kernels count)
    return {id(master) for _group, master, _s, _g, _w in taken}
