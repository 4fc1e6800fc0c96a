"""What a training forward saves for its backward, per block, measured on
fake tensors before it runs (`measure_saved`, a `SavedBytes`:
training/saved_bytes.py says what each `activations=` policy then holds on
the device): the plan a training step's budget is decided from
(`Activations.plan_pass`, and `pager.plan(..., inputs=)`); and the bytes of
an optimizer's state (`state_bytes_of`).

[Note: activations measured without running]
`torch.func.functional_call` runs the model with fake stand-ins of its
parameters and buffers (the model is not changed; a paged-out tensor's
stand-in is made from its shape alone, nothing is fetched) under a
`FakeTensorMode`, inside saved-tensor hooks that see each tensor autograd
saves. A saved tensor is attributed to the innermost block whose forward is
running (temporary forward hooks keep the stack), or, saved by ops between
blocks, to the block before them (offloading sends those with it); by
storage for keeping and recomputing (a view saved again counts once, where
it was first saved), by view for offloading (it sends each view a block
saves once); storages of parameters and buffers are not activations (they
page with their block). What a block's
forward is called with is recorded too: `activations="recompute"` keeps
exactly that. Compiled modules run eagerly for it (`torch.compiler.set_stance`:
a compiled kernel would read the fake tensors' memory, which they have
none of). While it runs, pager's own hooks stand aside (`dry_running`):
the measure moves no bytes and counts no use. The random number generators'
states are put back after it, and so is what the forward set on the model's
modules (a cache, a counter: each module's attributes, shallowly). What the
forward does to objects outside the model (a list a user's hook appends to)
happens once more, with fake tensors, as a recomputation runs a block's
forward again. A forward that cannot run on fake tensors (it
reads values: `.item()`, data-dependent shapes) is reported, not guessed.

[Note: what sits outside pager, predicted]
Under a budget that covers the process ([Note: a budget that covers the
process] in model/outside.py) blocks must leave room, from the first step,
for what the process holds beside them: the forward's inputs, its output
(a language model's logits: 4x1024 tokens of a 32000-word vocabulary are
0.5 GiB in float32), and the backward of the loss over it, which holds the
gradient of the log-softmax's output and that of the logits at once
(GRADS_OF_A_LOSS tensors of the output's size, in float32 however narrow
the output: losses compute in it). What a loss computed inside the forward
saves is an activation, counted above; a loss the caller computes over the
output (no scalar among the outputs) saves its log-softmax outside pager:
one more. So `outside_peak` is the inputs (each by itself), the outputs
(each storage once, those pager holds excluded) and 2 (a loss inside) or 3
(outside) float32 copies of the largest output that needs a gradient. It is
a prediction; on CUDA the allocator's counters then correct it upward,
never downward (a peak hidden under the forward's says nothing:
model/outside.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from ..base import wrappers
from ..base.block import ALIGN_BYTES, align
from ..base.common import set_dry_running
from ..base.registry import unguarded
from ..base.wrappers import aligned_bytes
from .masters import wants_master
from .saved_bytes import Save, SavedBytes

_GONE = object()
log = logging.getLogger("pager")

GRADS_OF_A_LOSS = 2  # float32 tensors of the output's size a loss's backward holds at once (see the Note)


def measure_saved(model: torch.nn.Module, named_blocks, args=(), kwargs=None, placed=None) -> SavedBytes:
    """Run `model`'s forward on fake tensors shaped like `args` and `kwargs`
    and count what it saves for its backward, per block ([Note: activations
    measured without running]). `placed`: {id of a tensor: the device its
    forward reads it on}, for tensors held elsewhere (paged experts' host
    tensors). Raises `ValueError` naming the cause if the forward cannot run
    on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    kwargs = kwargs or {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # (tensors the model holds outside its state: made fake)
    names = [n for n, _m in named_blocks]
    index = {id(m): i for i, (_n, m) in enumerate(named_blocks)}
    fakes = _fake_state(model, mode, placed or {})
    with mode:
        fake_args, fake_kwargs = tree_map(
            lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
        )
    own = {_key(t) for t in fakes.values()}
    sb = SavedBytes(names, [0] * len(names), [0] * len(names), 0, [], [[] for _ in names], [[] for _ in names])
    sb.within, sb.flops, sb.backward_flops = [-1] * len(names), [0] * len(names), [0] * len(names)
    by_dtype: dict = {}
    seen: set = set()
    inputs_seen: set = set()
    inputs_alive: list = []
    used: set = set()  # the blocks whose forward began
    stack: list[int] = []

    last = [-1]  # the module of the last block whose forward began (its id; -1: none yet)

    def pre(module, a, k):
        i = index[id(module)]
        outer = stack[-1] if stack else -1
        # (a block used inside another and by itself too: recomputed by itself, the cautious prediction)
        sb.within[i] = outer if i not in used or sb.within[i] == outer else -1
        used.add(i)
        stack.append(i)
        last[0] = id(module)
        sb.order.append(names[i])
        for t in tree_flatten((a, k))[0]:
            if isinstance(t, torch.Tensor) and _key(t) not in own and _key(t) not in inputs_seen:
                inputs_seen.add(_key(t))
                inputs_alive.append(t)  # (a storage freed while the forward runs could give its key to a new one)
                sb.inputs[i] += t.untyped_storage().nbytes()

    def post(module, a, out):
        stack.pop()

    def count(flops: int, backward: int, dtype) -> None:
        if stack:
            sb.flops[stack[-1]] += flops
            sb.backward_flops[stack[-1]] += backward
        else:
            sb.outside_flops += flops
            sb.outside_backward_flops += backward
        by_dtype[dtype] = by_dtype.get(dtype, 0) + flops

    def pack(t):
        key = _key(t)
        if key in own:
            return t
        view = (key, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        save = Save(t.numel() * t.element_size(), t.untyped_storage().nbytes(), t.is_contiguous(), _dense(t), key, view)
        i = stack[-1] if stack else None
        if i is not None:
            sb.saves[i].append(save)
        elif sb.order:  # (after a block: offloaded with it)
            sb.after[index[last[0]]].append(save)
        else:
            sb.before.append(save)
        if key not in seen:  # (each storage once, for keeping and recomputing)
            seen.add(key)
            if i is not None:
                sb.saved[i] += save.storage_bytes
            else:
                sb.outside += save.storage_bytes
                sb.outside_before += 0 if sb.order else save.storage_bytes
        return t

    handles = [
        h
        for _n, m in named_blocks
        for h in (m.register_forward_pre_hook(pre, with_kwargs=True), m.register_forward_hook(post, always_call=True))
    ]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    # What a forward sets on its modules (a cache, a counter) is put back: the measure changes nothing.
    attributes = {m: dict(m.__dict__) for m in model.modules()}
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")  # (it logs a failing meta kernel at ERROR:
    quiet, fake_log.disabled = fake_log.disabled, True  # the failure is reported below, once)
    set_dry_running(True)
    try:
        # (compiled blocks run eagerly here: their compiled kernels would read fake tensors' memory)
        with mode, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.compiler.set_stance("force_eager"), _Flops(count):
                out = functional_call(model, fakes, fake_args, fake_kwargs, tie_weights=True, strict=False)
        sb.flops_dtype = max(by_dtype, key=by_dtype.__getitem__) if by_dtype else None
        sb.outside_peak = _outside_peak((fake_args, fake_kwargs), out, own | seen)
    except Exception as e:  # noqa: BLE001 - the model's own code: report what it raised
        raise ValueError(
            f"pager: the model's forward could not run on fake tensors to measure its activations "
            f"({type(e).__name__}: {str(e)[:200]}); a forward that reads tensor values (.item(), data-dependent "
            f"shapes) cannot be measured this way."
        ) from e
    finally:
        set_dry_running(False)
        fake_log.disabled = quiet
        for h in handles:
            h.remove()
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for m, before in attributes.items():
            now = m.__dict__
            if len(now) != len(before) or any(now.get(k, _GONE) is not v for k, v in before.items()):
                now.clear()
                now.update(before)
    return sb


_ADDED_FIRST = {"addmm", "baddbmm", "addbmm", "addmv", "addr"}  # ops whose first tensor is added to the product


class _Flops(TorchDispatchMode):
    """Counts the FLOPs of the ops torch's flop counter knows (matmuls,
    convolutions, attention) as they run on the fake tensors: `count(flops,
    backward, dtype)` for each, `backward` its backward's predicted (as many
    again for each of its first two operands that needs a gradient: a frozen
    weight's matmul computes its input's alone). Higher-order ops (flex
    attention) pass through it. A count is an estimate for "auto"'s choice:
    one the flop counter cannot make (a shape its formula does not take) is
    logged at DEBUG and left out."""

    supports_higher_order_operators = True

    def __init__(self, count):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops_of = flop_registry.get(getattr(func, "overloadpacket", func))
        if flops_of is not None:
            try:
                flops = int(flops_of(*args, **kwargs, out_val=out))
            except Exception as e:  # noqa: BLE001 - torch's formula: the measure of saves goes on without it
                log.debug("pager: the FLOPs of %s not counted (%s: %s)", func, type(e).__name__, e)
                return out
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            first = 1 if getattr(func, "_opname", "") in _ADDED_FIRST else 0  # (addmm's bias is not an operand)
            grads = sum(t.requires_grad for t in tensors[first : first + 2])
            self.count(flops, grads * flops, tensors[first].dtype if len(tensors) > first else None)
        return out


def _outside_peak(inputs, out, counted: set) -> int:
    """What the process holds on the device outside pager at a training
    step's peak, predicted from the forward's inputs and output ([Note: what
    sits outside pager, predicted]); `counted`: storages that are pager's
    (parameters, buffers, saved activations)."""
    # (each input by itself, however they share storage: a plan's inputs then count as the run's do)
    held = sum(t.numel() * t.element_size() for t in _tensors(inputs))
    seen, largest, loss = set(counted), 0, False
    for t in _tensors(out):
        if _key(t) not in seen:
            seen.add(_key(t))
            held += t.untyped_storage().nbytes()
    for t in _tensors(out):
        if t.requires_grad and t.is_floating_point():
            loss = loss or t.numel() == 1
            largest = max(largest, t.numel() * max(4, t.element_size()))
    return held + (GRADS_OF_A_LOSS if loss else GRADS_OF_A_LOSS + 1) * largest


def _tensors(tree) -> list:
    """The tensors in `tree`: tuples, lists, dicts and mappings (a Hugging Face
    `ModelOutput`) searched."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (tuple, list)):
        return [t for v in tree for t in _tensors(v)]
    return []


def _fake_state(model: torch.nn.Module, mode, placed: dict) -> dict:
    """A fake stand-in of each parameter and buffer of `model`, by name (a
    tied tensor: one for all its names); a paged-out one made from its shape
    alone (its storage is empty: nothing is read or fetched), as is one of
    `placed` (on the device named there)."""
    state: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    fakes: dict = {}
    by_id: dict = {}
    with unguarded():
        for name, t in state.items():
            if id(t) not in by_id:
                grad = t.requires_grad and t.is_floating_point()
                if _has_bytes(t) and id(t) not in placed:
                    fake = mode.from_tensor(t.detach())
                else:
                    with mode:
                        device = placed.get(id(t), t.device)
                        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                by_id[id(t)] = fake.requires_grad_(grad)
            fakes[name] = by_id[id(t)]
    return fakes


def _has_bytes(t: torch.Tensor) -> bool:
    """Whether `t`'s storage holds its elements (not a paged-out tensor's
    empty one). A wrapper subclass (a quantized weight) is made from its
    shape as a plain tensor: its kernels save about what a plain weight's
    do, and its inner tensors may be paged out."""
    if wrappers.is_wrapper(t):
        return False
    if t.numel() == 0:
        return True
    return t.untyped_storage().nbytes() >= (t.storage_offset() + 1) * t.element_size()


def _dense(t: torch.Tensor) -> bool:
    """Whether `t` covers a run of its storage's bytes without gaps or
    overlaps (contiguous, or a permutation of it: a transposed view)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _key(t) -> int:
    return t.untyped_storage()._cdata


def state_bytes_of(optimizer, device, state_factor: float = 2.0, master_weights: bool = False, groups=None):
    """Page bytes of the optimizer state a parameter has on `device`: its
    tensors the size of the parameter, and its scalars (`step`), each in a
    slot of its own. Without an optimizer, `state_factor` x the parameter.
    Under `master_weights` a bf16 parameter's are float32, and its master
    is one more ([Note: master weights] in training/masters.py). `groups`:
    id of each parameter -> its param group (by default, the optimizer's
    groups as they are now)."""

    def widened(p) -> tuple[int, int]:  # (bytes of one state tensor of `p`, of its master)
        if master_weights and wants_master(p):
            wide = align(4 * p.numel())
            return wide, wide
        return aligned_bytes(p), 0

    if optimizer is None:
        return lambda p: int(state_factor * widened(p)[0]) + widened(p)[1]
    if groups is None:
        groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    name = type(optimizer).__name__

    def of(p):
        g = groups.get(id(p), {})
        copies, scalars = _STATE.get(name, (state_factor, 1))
        if callable(copies):
            copies = copies(g)
        # torch keeps `step` beside the parameter only when fused or capturable (else on the CPU)
        here = device.type == "cpu" or g.get("fused") or g.get("capturable")
        one, master = widened(p)
        return int(copies * one) + master + (scalars * ALIGN_BYTES if here else 0)

    return of


# optimizer class -> (state tensors the size of a parameter, or a function of its group; scalar tensors)
_STATE: dict[str, tuple[int | Callable[[dict], int], int]] = {
    "Adam": (lambda g: 3 if g.get("amsgrad") else 2, 1),
    "AdamW": (lambda g: 3 if g.get("amsgrad") else 2, 1),
    "Adamax": (2, 1),
    "NAdam": (2, 2),
    "RAdam": (2, 1),
    "Adagrad": (1, 1),
    "Adadelta": (2, 1),
    "RMSprop": (lambda g: 1 + (g.get("momentum", 0) > 0) + bool(g.get("centered")), 1),
    "SGD": (lambda g: 1 if g.get("momentum", 0) else 0, 0),
}
