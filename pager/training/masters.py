"""float32 master weights for a model of lower precision (`wrap(master_weights=True)`).

[Note: master weights]
A bf16 (or fp16) model trained by a torch optimizer gets state of its own
dtype and an update rounded to it: Adam's moments in bf16, and an update
smaller than half a bf16 ulp of the weight lost. Mixed-precision training
keeps a float32 copy of each such weight (its master) and float32 state,
steps the copy with the gradient in float32, and gives the weight the
copy's rounding: ZeRO-Offload's bf16 mode, apex's O2.

Under `master_weights=True` the master is one more entry of the parameter's
optimizer state, `optimizer.state[p]["master_weight"]`, so it pages with
the block's state (the state page, in host memory between uses), is saved
by `optimizer.state_dict()` and comes back with `load_state_dict()` (where
torch casts state to the parameter's dtype, the saved float32 values are
put back), and never makes a second copy of the weights on the device
while the block is away. A parameter's first update makes it from the
weight as it is (`p.float()`); the state the update makes is then float32.

Each update runs the optimizer's own undecorated step on a shadow of it
([Note: deferred updates] in training/optim.py) whose parameters are the
masters, one parameter at a time: its bf16 gradient is converted into a
float32 scratch tensor first (on the host one buffer is reused, grown to
the largest gradient: a fresh one would fault in its pages every time), and
afterwards the weight gets `copy_` of the master. On the host of a CUDA
run, torch's Adam and AdamW do the three in one pass instead ([Note: a
master's update in one pass] in training/master_pass.py). Wherever the update runs
(on the device at `step()`, deferred to the block's next fetch, or on the
host over the pages: [Note: the optimizer step on the host]), the bytes
that cross the link are those of the bf16 weights and gradients; the master
and the state cross it only with a device update, as all state does.

On the CPU device the result is, bit for bit, the loop that keeps masters
by hand: `master.grad = p.grad.float()`, the optimizer on the masters,
`p.copy_(master)` (tests/test_masters.py).

Parameters of float32 or wider have no master: they step as without the
option, in the same shadow.
"""

from __future__ import annotations

import threading

import torch

from . import master_pass
from .shadow import shadow_of

MASTER = "master_weight"  # the optimizer-state key of a parameter's float32 master


def wants_master(p: torch.Tensor) -> bool:
    """Whether `p` gets a float32 master: floating, narrower than float32."""
    return p.dtype.is_floating_point and p.dtype.itemsize < 4


_scratch = threading.local()  # each thread's float32 gradient buffer on the host


def float_grad(grad: torch.Tensor) -> torch.Tensor:
    """`grad` in float32: on the host a view of this thread's reused buffer
    (valid until its next call); on a device a new tensor (the caching
    allocator reuses its block)."""
    if grad.device.type != "cpu":
        return grad.float()
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < grad.numel():
        buffer = _scratch.buffer = torch.empty(grad.numel(), dtype=torch.float32)
    out = buffer[: grad.numel()].view(grad.shape)
    out.copy_(grad)
    return out


def without_master(own: dict) -> dict:
    """A parameter's state entries for an update on its master: all but the master."""
    return {k: v for k, v in own.items() if k != MASTER}


def step_each(raw_step, shadow, rounded: dict, one_pass: bool = False) -> int:
    """Run `raw_step` over `shadow`'s parameters one at a time. For each in
    `rounded` (id of a master -> (its low-precision gradient, the weight
    that gets its rounding)), the gradient is given in float32 for the
    update, and the weight gets the master's value after it; or, with
    `one_pass`, all three in one pass for the masters it takes ([Note: a
    master's update in one pass] in training/master_pass.py). Returns how
    many masters were updated in one pass."""
    taken = set()
    if one_pass:
        taken = master_pass.update(
            shadow,
            [
                (group, stand_in, shadow.state.get(stand_in, {}), *rounded[id(stand_in)])
                for group in shadow.param_groups
                for stand_in in group["params"]
                if id(stand_in) in rounded
            ],
        )
    for group in shadow.param_groups:
        for stand_in in group["params"]:
            if id(stand_in) in taken:
                continue
            low = rounded.get(id(stand_in))
            if low is not None:
                stand_in.grad = float_grad(low[0])
            try:
                raw_step(shadow_of(shadow, [{**group, "params": [stand_in]}]))
            finally:
                if low is not None:
                    stand_in.grad = None
            if low is not None:
                with torch.no_grad():
                    low[1].copy_(stand_in)
    return len(taken)


def device_update(raw_step, optimizer, groups: list) -> None:
    """`optimizer`'s update of the parameters in `groups` (its param groups
    narrowed to them, their pages on the device, their `.grad` set) on
    their masters, made here for a parameter's first update. The masters
    and the state the update made go into `optimizer.state`."""
    state, rounded, made, shadow_groups = {}, {}, [], []
    for group in groups:
        params = []
        for p in group["params"]:
            if p.grad is None:
                continue  # (the update passes over it, as torch's would)
            own = optimizer.state[p]
            if not wants_master(p):
                state[p] = own
                params.append(p)
                continue
            master = own.get(MASTER)
            if master is None:
                master = p.detach().float()
            state[master] = without_master(own)
            rounded[id(master)] = (p.grad, p)
            made.append((own, master))
            params.append(master)
        shadow_groups.append({**group, "params": params})
    step_each(raw_step, shadow_of(optimizer, shadow_groups, state), rounded)
    for own, master in made:
        own.update(state[master])
        own[MASTER] = master


def param_names(pager) -> dict:
    """id of each block parameter -> its qualified name (for messages)."""
    return {id(p): n for b in pager.all_blocks() for n, p in zip(b.param_names, b.params)}


def check_attached_state(optimizer, names: dict) -> None:
    """At `attach`: state the optimizer already holds for a parameter with a
    master must be this option's, float32 (raises, naming the parameter),
    or what the optimizer's constructor made (Adagrad's sum and step), which
    is made again for a float32 master (`made_at_construction`)."""
    remade = []  # (state, its float32 remake): put in only once nothing is refused
    for group in optimizer.param_groups:
        for p in group["params"]:
            own = optimizer.state.get(p)
            if not own or id(p) not in names or not wants_master(p):
                continue
            if MASTER not in own:
                fresh = made_at_construction(optimizer, group, p, own)
                if fresh is None:
                    raise ValueError(
                        f"pager: the optimizer holds state for {names[id(p)]!r} ({p.dtype}) without a float32 "
                        f"master: made or loaded without master_weights=True. Give this model an optimizer with "
                        f"fresh state, or wrap it without master_weights."
                    )
                remade.append((own, fresh))
            elif own[MASTER].dtype != torch.float32:
                raise ValueError(
                    f"pager: the optimizer's state was loaded before pager attached it, and torch's load_state_dict "
                    f"cast the float32 master of {names[id(p)]!r} and its state to {p.dtype}. Attach it first, "
                    f"then load: pager.of(model).attach(opt) (or wrap(..., optimizer=opt)), then "
                    f"opt.load_state_dict(...)."
                )
    for own, fresh in remade:
        own.clear()
        own.update(fresh)  # (its first update makes the master: `device_update`)


def made_at_construction(optimizer, group: dict, p: torch.Tensor, own: dict) -> dict | None:
    """If `own` (`p`'s state) is what `optimizer`'s class makes for `p` in
    its constructor, the same for a float32 master of `p`, on `own`'s
    devices; else None. Judged from optimizers of the class over one-element
    stand-ins (of `p`'s dtype, and of float32) with `group`'s options: an
    entry of the stand-in's shape is per element, and `own`'s must hold
    that one value everywhere."""
    options = {k: group[k] for k in optimizer.defaults if k in group}
    shape = (1,) * p.dim()
    try:
        low, high = (
            type(optimizer)([torch.zeros(shape, dtype=dtype)], **options) for dtype in (p.dtype, torch.float32)
        )
    except (TypeError, ValueError, RuntimeError):
        return None
    low_state: dict = next(iter(low.state.values()), {})
    high_state: dict = next(iter(high.state.values()), {})
    if set(low_state) != set(own) or set(high_state) != set(own):
        return None
    fresh = {}
    for key, value in own.items():
        made = low_state[key]
        if not isinstance(value, torch.Tensor) or not isinstance(made, torch.Tensor):
            if value != made:
                return None
            fresh[key] = high_state[key]
            continue
        per_element = made.shape == shape and value.shape == p.shape
        if not per_element and made.shape != value.shape:
            return None
        made = made.to(value.device)
        if not torch.equal(value, made.expand(value.shape) if per_element else made):
            return None
        made_high = high_state[key]
        fresh[key] = (made_high.expand(p.shape).clone() if per_element else made_high).to(value.device)
    return fresh


def saved_float32(optimizer, state_dict: dict, names: dict) -> dict:
    """From a state dict about to be loaded: (id of a parameter with a
    master, key) -> a copy of each floating state value but Adam's `step`
    (the master and the moments), which `load_state_dict` casts to the
    parameter's dtype; `restore_float32` puts them back. Parameters map to
    the saved ids in group order, as `load_state_dict` maps them. Raises,
    before anything is loaded, for state saved without masters (`names`:
    id of a parameter -> its qualified name, for the message)."""
    saved_ids = [i for g in state_dict.get("param_groups", ()) for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    kept = {}
    for saved_id, p in zip(saved_ids, params):
        entries = state_dict.get("state", {}).get(saved_id)
        if not entries or not wants_master(p) or id(p) not in names:
            continue
        if MASTER not in entries:
            raise ValueError(
                f"pager: the optimizer state being loaded has no float32 master for {names[id(p)]!r} "
                f"({p.dtype}): it was saved without master_weights=True. Load it into a model wrapped without "
                f"master_weights, or start this one from its optimizer's fresh state."
            )
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "step":
                kept[(id(p), key)] = value.detach().to("cpu", torch.float32, copy=True)
    return kept


def restore_float32(optimizer, kept: dict) -> None:
    """Put back the float32 values `saved_float32` kept, where
    `load_state_dict` left the cast ones (their device)."""
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        own = optimizer.state.get(p)
        for key, value in (own or {}).items():
            original = kept.get((id(p), key))
            if original is not None:
                own[key] = original.to(value.device)


def narrowed(own: dict, dtype: torch.dtype) -> dict:
    """A parameter's state for its optimizer without pager (`unwrap`): no
    master, and its floating entries but `step` in the parameter's `dtype`,
    as torch's own update of that parameter keeps them."""
    return {
        k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step" else v)
        for k, v in own.items()
        if k != MASTER
    }
