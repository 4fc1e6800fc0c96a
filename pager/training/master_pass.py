"""A float32 master's Adam or AdamW update on the host in one pass.

[Note: a master's update in one pass]
Under `master_weights=True`, an update on the host of a bf16 parameter is
three passes over host memory: the gradient converted to float32, torch's
fused AdamW over the master and moments, and the master rounded into the
weights page ([Note: master weights] in training/masters.py). Host memory
is what they wait for: on an H100's 16-core host, one 202M-parameter
layer of Llama-7B's shape took 64 ms in three passes, and the fused kernel
alone (given float32 gradients) 34 ms. In the 7B-shaped fine-tune these
updates were the step: 24 of them, one after another, were most of its
1.7 s.

Here the three passes are one loop, compiled by `torch.compile` (inductor's
C++ for the CPU). It reads the bf16 gradient, the master and the two
moments once. It writes the moments, the master and the bf16 weight once.
The same layer took 40 ms on pager's worker.

Where it runs: where the fused CPU kernel would (a CUDA run; on the CPU
device an update is the optimizer's own code, bit for bit), for
`torch.optim.Adam` and `AdamW` with options it computes as torch's kernel
does (not amsgrad, capturable or differentiable), for contiguous pages. The
arithmetic is torch's fused CPU kernel's (`FusedAdamKernel.cpp`) in
float32, so the result lands within that kernel's rounding. A parameter it
does not take goes the three passes' way.

Compiling needs a C++ compiler. It is tried once per process, on a small
probe, by the first update on the host that can use it (on the worker, not
in the training loop's thread). The probe must match the uncompiled loop.
Where compiling or the probe fails, pager logs why (a warning) and keeps the
three passes.
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger("pager")

CLASSES = ("Adam", "AdamW")  # torch.optim classes updated here


def adam_pass(grad, master, exp_avg, exp_avg_sq, weight, c):
    """One Adam/AdamW update of `master` (and its moments) from `grad` (its
    bf16 or fp16 gradient), in place, with `weight` given the master's
    rounding. All 1-D, contiguous. `c` (float32): step size, the square
    root of the second bias correction, 1 - lr x weight decay (AdamW; else
    1), weight decay (Adam; else 0), 1 - beta1, beta2, 1 - beta2, eps, and
    -1 to maximize (else 1). In the order of torch's fused CPU kernel."""
    g = grad.float() * c[8]
    g = g + master * c[3]  # (Adam's weight decay: into the gradient)
    m = exp_avg + (g - exp_avg) * c[4]  # (torch's lerp, for a weight below 0.5)
    v = exp_avg_sq * c[5] + g * g * c[6]
    p = master * c[2]  # (AdamW's: on the master)
    p = p - c[0] * m / (v.sqrt() / c[1] + c[7])
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    master.copy_(p)
    weight.copy_(p)


class OnePass:
    """`adam_pass` compiled, made once per process ([Note: a master's update in one pass])."""

    _lock = threading.Lock()
    _compiled = None
    _tried = False

    @classmethod
    def kernel(cls):
        """The compiled pass, or None where it could not be made."""
        with cls._lock:
            if not cls._tried:
                cls._tried = True
                cls._compiled = cls._made()
            return cls._compiled

    @staticmethod
    def _made():
        try:
            compiled = torch.compile(adam_pass, dynamic=True, fullgraph=True)
            probe = _probe()
            expected = _probe()
            adam_pass(*expected)
            compiled(*probe)
            for got, want in zip(probe[1:5], expected[1:5]):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
            return compiled
        except Exception as error:  # (no compiler, an inductor that cannot, a result not as expected)
            log.warning("pager: a float32 master's update on the host in one pass could not be compiled (%r); "
                        "its three passes run instead (slower: [Note: a master's update in one pass])", error)
            return None


def _probe() -> tuple:
    gen = torch.Generator().manual_seed(0)
    n = 1000  # (a size of no special case: the compiled loop is for any)
    master = torch.randn(n, generator=gen)
    return (torch.randn(n, generator=gen).to(torch.bfloat16), master, torch.randn(n, generator=gen) * 0.1,
            torch.rand(n, generator=gen), master.to(torch.bfloat16),
            torch.tensor([1e-3, 0.5, 0.9999, 0.01, 0.1, 0.999, 0.001, 1e-8, 1.0]))


def takes(optimizer) -> bool:
    """Whether `optimizer`'s class is updated here (torch.optim's Adam or AdamW)."""
    cls = type(optimizer)
    return cls.__module__.split(".")[:2] == ["torch", "optim"] and cls.__name__ in CLASSES


def update(optimizer, group: dict, master, state: dict, grad, weight) -> bool:
    """`master`'s update by `optimizer`'s class with `group`'s options and
    its `state`, from `grad`, rounded into `weight`, in one pass; False
    (nothing changed) where this pass does not take it."""
    step = state.get("step")
    if (group.get("amsgrad") or group.get("capturable") or group.get("differentiable")
            or not isinstance(step, torch.Tensor) or step.numel() != 1
            or "exp_avg" not in state or "exp_avg_sq" not in state):
        return False
    tensors = (grad, master, state["exp_avg"], state["exp_avg_sq"], weight)
    if any(t.device.type != "cpu" or not t.is_contiguous() or t.numel() != master.numel() for t in tensors) \
            or any(t.dtype != torch.float32 for t in tensors[1:4]):
        return False
    kernel = OnePass.kernel()
    if kernel is None:
        return False
    with torch.no_grad():
        kernel(*(t.view(-1) for t in tensors), coefficients(optimizer, group, float(step) + 1))
    step += 1  # (in place, as torch's kernels count)
    return True


def coefficients(optimizer, group: dict, step: float) -> torch.Tensor:
    """`adam_pass`'s `c` for this update, in double as torch's kernel
    reckons them, then float32."""
    lr, (beta1, beta2) = float(group["lr"]), map(float, group["betas"])
    decay = group.get("weight_decay", 0.0)
    decoupled = type(optimizer).__name__ == "AdamW" or group.get("decoupled_weight_decay", False)
    return torch.tensor([lr / (1 - beta1 ** step), (1 - beta2 ** step) ** 0.5,
                         1 - lr * decay if decoupled else 1.0, 0.0 if decoupled else decay,
                         1 - beta1, beta2, 1 - beta2, group["eps"], -1.0 if group.get("maximize") else 1.0],
                        dtype=torch.float32)
