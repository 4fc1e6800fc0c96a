"""What one block's optimizer update on the host is made of: `HostJob`, a
shadow of the optimizer over the block's host pages ([Note: the optimizer
step on the host] in training/host_step.py), and `host_job`, which makes it
at `step()` from the user's optimizer."""

from __future__ import annotations

import collections
import time

import torch

from ..base.block import PageState
from . import master_pass, masters
from .grads import PagedOutGrad, replay
from .shadow import shadow_of


class AfterCopy:
    """Work for the host worker once a copy has landed (`fn` on the worker:
    publishing a block's update, [Note: block owners] in training/owners.py)."""

    def __init__(self, event, fn):
        self.event, self.fn = event, fn

    def landed(self) -> bool:
        return self.event is None or self.event.query()

    def run(self) -> AfterCopy:
        self.fn()
        return self


class HostJob:
    """One block's update on the host: a shadow optimizer over its pages."""

    def __init__(
        self,
        step,
        shadow,
        entries: list,
        scales: list,
        after: list,
        rounded: dict,
        one_pass: bool = False,
        grad_factor=None,
        weight_bytes: int = 0,
    ):
        self.step = step  # the optimizer class's undecorated step
        self.shadow = shadow  # its groups and state over the host pages
        self.entries = entries  # (name, the optimizer's state dict of a parameter, the shadow's, its keys in the page)
        self.scales = scales  # (host view of a gradient, [(op, host factor)]) to apply first
        # every gradient's factor, taken by the fused kernel ([Note: a clip in the fused update])
        self.grad_factor = grad_factor
        self.after = after  # CUDA events: pages written back, factors copied
        self.rounded = rounded  # id of a master -> (gradient, weight) ([Note: master weights] in training/masters.py)
        self.one_pass = one_pass  # masters' updates in one pass where it can ([Note: a master's update in one pass])
        self.seconds = 0.0
        self.passes = 0  # masters updated in one pass
        self.weight_bytes = weight_bytes  # of the block whose update this is (what its time is measured against)

    def landed(self) -> bool:
        """The pages' write-backs (and the factors' copies) have landed in host memory."""
        return all(event.query() for event in self.after)

    def run(self) -> HostJob:
        for event in self.after:
            event.synchronize()  # (a guard: the worker runs only jobs that have landed)
        start = time.perf_counter()
        with torch.no_grad():
            for view, ops in self.scales:
                replay(view, ops)
        if self.grad_factor is not None:
            self.shadow.grad_scale = grad_scale(self.grad_factor)
        given = [dict(shadow) for _n, _own, shadow, _page in self.entries]
        if self.rounded:
            self.passes = masters.step_each(self.step, self.shadow, self.rounded, self.one_pass)
        else:
            self.step(self.shadow)
        self._put_back(given)
        self.seconds = time.perf_counter() - start
        return self

    def _put_back(self, given: list) -> None:
        """State entries the optimizer replaced rather than updated in place:
        into the page, or (host-side ones) into the optimizer's state."""
        for (name, own, shadow, page), before in zip(self.entries, given):
            for key, value in shadow.items():
                if key not in before:
                    raise RuntimeError(
                        f"pager: the optimizer made new state {key!r} for {name!r} in an update on the host (an "
                        f"option that adds state, such as amsgrad or momentum, turned on after the first step?); "
                        f'its page has no room for it. Wrap with optimizer_step="device" for such changes.'
                    )
                if value is not before[key]:
                    if key in page:
                        with torch.no_grad():
                            before[key].copy_(value)
                    else:
                        own[key] = value


def host_job(link, block, shares: list, options: list, factors: dict, after: list) -> HostJob:
    """`block`'s update as `link`'s optimizer would run it at this `step()`:
    its parameters' stand-ins over the weights page with the grads page's
    views as gradients, the state page's views as state, the groups'
    options as they are now (`options`), and the zeroing and scaling
    recorded on its gradients to apply first (their pending list is then
    cleared: what comes later applies after the update). `factors` and
    `after` are shared by a step's jobs (`host_factor`)."""
    optimizer, pager = link.optimizer, link.pager
    weights, grads, state = block.segments["weights"], block.segments["grads"], block.segments.get("state")
    weights_host = dict(zip(map(id, weights.tensors), weights.host_views()))
    grads_host = grads.host_views()
    state_host = dict(zip([(id(p), key) for p, key in state.keys], state.host_views())) if state else {}
    fused = pager.host_steps.fused_on_host(optimizer)
    override = {"fused": True, "foreach": False} if fused else {}
    shadow_state: collections.defaultdict = collections.defaultdict(dict)
    groups, entries, rounded, stepped = [], [], {}, set()
    for g, share, opts in zip(optimizer.param_groups, shares, options):
        stand_ins = []
        for p in share:
            if not isinstance(p.grad, PagedOutGrad):
                continue  # (its gradient is None: the update passes over it)
            stepped.add(p.grad.position)
            stand_in = weights_host[id(p)]
            if pager.master_weights and masters.wants_master(p):
                rounded[id(state_host[(id(p), masters.MASTER)])] = (grads_host[p.grad.position], stand_in)
                stand_in = state_host[(id(p), masters.MASTER)]  # (its first update, on the device, made it)
            else:
                stand_in.grad = grads_host[p.grad.position]
            own = masters.without_master(optimizer.state.get(p) or {})
            if own:
                shadow_state[stand_in] = {k: state_host.get((id(p), k), v) for k, v in own.items()}
                entries.append(
                    (
                        p.grad.param_name,
                        optimizer.state[p],
                        shadow_state[stand_in],
                        {k for k in own if (id(p), k) in state_host},
                    )
                )
            stand_ins.append(stand_in)
        groups.append({**g, **opts, **override, "params": stand_ins})
    factor = one_factor(grads.pending, stepped) if fused and not rounded and not amp_scaled(optimizer) else None
    if factor is not None and any(grads_host[i].dtype == torch.float64 for i in stepped):
        factor = None  # (the kernels' grad_scale is float32: a float64 gradient is scaled by the replay)
    if factor is not None:  # ([Note: a clip in the fused update])
        scales, factor = [], host_factor(factor, factors, pager.transport, after)
    else:
        scales = [
            (grads_host[i], [(op, host_factor(f, factors, pager.transport, after)) for op, f in ops])
            for i, ops in grads.pending.items()
        ]
    for i in grads.pending:
        grads.summaries.pop(i, None)  # (the page will hold the scaled gradient)
    grads.pending.clear()  # what is recorded from now on applies after the update
    return HostJob(
        link.raw_step,
        shadow_of(optimizer, groups, shadow_state),
        entries,
        scales,
        writeback_events(block) + after,
        rounded,
        one_pass=fused and master_pass.takes(optimizer),
        grad_factor=factor,
        weight_bytes=weights.nbytes,
    )


# [Note: a clip in the fused update]
# torch's `clip_grad_norm_` scales every gradient by one coefficient
# (`_foreach_mul_`); on a paged-out gradient it is recorded, and the update
# on the host used to apply it first, as a pass of its own over the block's
# gradients in host memory: 8 more bytes a parameter read and written by a
# host whose AdamW moves 28, on the path the next forward waits for (a 1B
# decoder's step at 1.16-1.66x the step without clip at 8da8073, H200). torch's fused
# CPU kernels (Adam, AdamW, SGD, Adagrad) take a `grad_scale` that each
# gradient is divided by as the kernel reads it, written back unscaled, the
# way GradScaler hands a fused optimizer its scale: the clip's reciprocal
# there makes the scaling part of the update's one pass, and the page then
# holds the scaled gradient, as after the clip on the device. g / (1/c)
# differs from g * c by at most an ulp: within the fused kernel's own
# rounding, which is why this runs only where that kernel does (on CUDA;
# the CPU device runs the optimizer's own code and replays the clip, bit
# for bit). Anything but one factor on every gradient the update steps
# (zeroing, two scalings, the scale GradScaler hands a fused optimizer,
# float64 gradients, which a float32 `grad_scale` would round) is replayed
# first. GradScaler's `unscale_` of a non-fused optimizer is one factor too,
# and is taken the same way.


def one_factor(pending: dict, stepped: set):
    """The factor a step's every gradient is scaled by and nothing else (one
    `clip_grad_norm_`), or None: `pending` (slot -> recorded operations)
    holds one ("mul", f) for each slot of `stepped`, the same f, a nonzero
    number or a tensor of one element ([Note: a clip in the fused update])."""
    if not stepped or set(pending) != stepped:
        return None
    first = next(iter(pending.values()))
    if len(first) != 1 or first[0][0] != "mul":
        return None
    factor = first[0][1]
    if (factor.numel() != 1) if isinstance(factor, torch.Tensor) else factor == 0:
        return None
    if any(len(ops) != 1 or ops[0][0] != "mul" or ops[0][1] is not factor for ops in pending.values()):
        return None
    return factor


def amp_scaled(optimizer) -> bool:
    """GradScaler hands a fused optimizer its scale for this step
    (`optimizer.grad_scale`): the kernel's one factor is taken."""
    return getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None


def grad_scale(factor) -> torch.Tensor:
    """What torch's fused kernels divide each gradient by for `factor` (a
    host tensor of one element, or a number): its reciprocal in float32."""
    if isinstance(factor, torch.Tensor):
        return torch.reciprocal(factor.detach().reshape(()).float())
    return torch.tensor(1.0 / factor, dtype=torch.float32)


def host_factor(factor, cache: dict, transport, after: list):
    """A scaling factor as the host reads it: a device tensor (a clip's
    coefficient) copied to pinned memory on the compute stream (the event
    it is done by goes into `after`), once per tensor per step."""
    if not isinstance(factor, torch.Tensor):
        return factor
    known = cache.get(id(factor))
    if known is not None:
        return known[1]
    if factor.device.type == "cuda":
        copy = torch.empty(factor.shape, dtype=factor.dtype, pin_memory=True)
        copy.copy_(factor, non_blocking=True)  # (on the compute stream, after the op that made it)
        after.append(transport.mark_compute())
    else:
        copy = factor.clone()  # (the step's value, whatever the caller does with the tensor later)
    cache[id(factor)] = (factor, copy)
    return copy


def writeback_events(block) -> list:
    """Events of write-backs of `block`'s pages that may still be running."""
    return [
        seg.writeback_event
        for seg in block.segments.values()
        if seg.state is PageState.WRITING_BACK and seg.writeback_event is not None
    ]
