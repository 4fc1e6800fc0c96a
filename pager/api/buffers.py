"""Non-persistent buffers of a model built on the meta device, made again on
the CPU for `pager.load`.

[Note: buffers a checkpoint does not hold]
A model built under `torch.device("meta")` (transformers' `from_config`,
the way its users build one without memory) has every tensor on meta. A
checkpoint gives the parameters and persistent buffers their values, but
not the non-persistent buffers a module computes when it is built (the
rotary embedding's `inv_freq` and `original_inv_freq`). They are made again
by building the module that owns them once more, on the CPU, from the
configuration it keeps (`module.config`, as Hugging Face modules do), and
taking that copy's buffers of the same names, shapes and dtypes. A module
that keeps no config (Gemma's scaled embedding, whose `embed_scale` is the
square root of the hidden size; CLIP's text embeddings, whose `position_ids`
count the positions) gets them from the transformers model's own
`_init_weights`, which transformers runs on what a checkpoint does not hold
after its own load: it runs on that module alone, its parameters still on
meta (their initialisation does nothing there), its buffers given memory
filled with NaN (an integer type's least value for integer buffers), taken
only where every value was written. A module that
cannot be made again either way is named in the error, with what to do.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def recreate_meta_buffers(model: nn.Module) -> list:
    """Give each non-persistent buffer of `model` that is on the meta
    device its value, computed by the module that owns it (see the Note).
    Returns (module, name, meta buffer) triples to undo it; raises, naming
    every buffer that cannot be made, before anything changes."""
    owners = [
        (prefix, m)
        for prefix, m in model.named_modules()
        if any(b is not None and b.is_meta and n in m._non_persistent_buffers_set for n, b in m._buffers.items())
    ]
    # Built under the default dtype the model was (its parameters'): a
    # buffer computed without an explicit dtype then comes out the same.
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    made, refused = [], []
    for prefix, module in owners:
        fresh, why = _build_again(module, dtype)
        initialised = _initialised(model, module) if fresh is None else {}
        for name, buf in module._buffers.items():
            if buf is None or not buf.is_meta or name not in module._non_persistent_buffers_set:
                continue
            value = getattr(fresh, "_buffers", {}).get(name) if fresh is not None else initialised.get(name)
            full = f"{prefix}.{name}" if prefix else name
            if value is None or value.is_meta or value.shape != buf.shape or value.dtype != buf.dtype:
                refused.append(f"{full} ({type(module).__name__}: {why or 'its copy has no such buffer'})")
            else:
                made.append((module, name, buf, value))
    if refused:
        raise ValueError(
            "pager: non-persistent buffers of the model are on the meta device and not in any checkpoint, and "
            f"pager could not compute them again by building their module on the CPU: {', '.join(refused)}. "
            "After building the model on meta, build those modules again on the CPU (e.g. "
            "`model.model.rotary_emb = type(model.model.rotary_emb)(config)`), then call pager.load."
        )
    undo = []
    for module, name, buf, value in made:
        module._buffers[name] = value
        undo.append((module, name, buf))
    return undo


def undo_buffers(undo: list) -> None:
    """Put back the meta buffers `recreate_meta_buffers` replaced."""
    for module, name, buf in undo:
        module._buffers[name] = buf


def _build_again(module: nn.Module, dtype: torch.dtype):
    """A copy of `module` built on the CPU from its `config` under the
    default `dtype`, or (None, why not)."""
    config = getattr(module, "config", None)
    if config is None:
        return None, "it keeps no `config` to build it again from"
    errors = []
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cpu"):
            for args, kwargs in (((config,), {}), ((), {"config": config})):
                try:
                    return type(module)(*args, **kwargs), None
                except Exception as e:  # (a constructor that wants other arguments)
                    errors.append(f"{type(e).__name__}: {e}")
    finally:
        torch.set_default_dtype(before)
    return None, f"building it again from its config failed ({errors[0]})"


def _initialised(model: nn.Module, module: nn.Module) -> dict:
    """`module`'s meta non-persistent buffers (floating or integer) as the
    transformers `model`'s own `_init_weights(module)` sets them (see the
    Note): name -> value, for those it wrote whole (none left at the fill:
    NaN, or an integer type's least value)."""
    init = getattr(model, "_init_weights", None)
    names = [
        n
        for n, b in module._buffers.items()
        if b is not None and b.is_meta and n in module._non_persistent_buffers_set and _unwritten(b.dtype) is not None
    ]
    if init is None or not names or any(not t.is_meta for t in [*module.parameters(), *module.buffers()]):
        return {}  # (its initialisation would overwrite values it has)
    metas = {n: b for n, b in module._buffers.items() if n in names and b is not None}
    for n, meta in metas.items():
        module._buffers[n] = torch.full(meta.shape, _unwritten(meta.dtype), dtype=meta.dtype)
    try:
        with torch.no_grad():
            init(module)
        values = {n: module._buffers[n] for n in names}
    except Exception:  # (an initialisation that cannot run on meta parameters: not made this way)
        values = {}
    finally:
        module._buffers.update(metas)
    return {
        n: v
        for n, v in values.items()
        if v is not None
        and not v.is_meta
        and not (torch.isnan(v) if v.is_floating_point() else v == _unwritten(v.dtype)).any()
    }


def _unwritten(dtype: torch.dtype):
    """A fill that no initialisation writes, of `dtype`: NaN, an integer
    type's least value; None for other types (bool, complex)."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype != torch.bool and not dtype.is_complex:
        return torch.iinfo(dtype).min
    return None
