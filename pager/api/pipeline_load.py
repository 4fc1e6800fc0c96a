"""`pager.from_pretrained` of a diffusers pipeline folder: every model
component built on the meta device and paged from its own files, in one pool.

A pipeline folder (`save_pretrained` of a `DiffusionPipeline`) has a
`model_index.json` naming each component's library and class, and a
subfolder per component. Loaded by diffusers, every model is read whole
into host memory (then pager would page a copy of it); here each model
component (a diffusers `ModelMixin` or a transformers `PreTrainedModel`) is
built on meta from its subfolder's configuration and given to `pager.load`
with the pool ([Note: reading checkpoints in place] in base/files.py): its
pages are the host copy. diffusers then builds the pipeline around them,
loading the rest (tokenizers, scheduler) as it does. Then it is as
`pager.wrap(pipe)` makes it ([Note: a pipeline under one budget] in
api/pipeline.py).
"""

from __future__ import annotations

import importlib
import json
import os
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..base.block import DIRECT_ALIGN, align_up
from ..base.budget import format_bytes
from ..base.files import most_common_float, open_checkpoint
from ..model.pool import Pool
from .load import load, page_bytes, parse_host_budget
from .pipeline import COMPONENT_OPTIONS, POOL_OPTIONS, WrappedPipeline, check_room, free_name, joins, register, undo


def pipeline_from_pretrained(folder: str, budget, *, pipeline_class=None, dtype=None, pool=None, **options):
    """The pipeline of `folder` (a `model_index.json` there), its models paged
    from their files under `budget` (or into `pool`). `options`: a component's
    name (`tokenizer=...`) goes to diffusers' `from_pretrained`, and a model
    given so (a transformer the caller quantized) is wrapped into the pool
    as `pager.wrap(pipe)` would; the pool's options (`device`, `pin`) go to
    the pool; `host_budget` is the pipeline's, shared among its models read
    from files (`_host_shares`); the rest go to each model's `pager.load`."""
    import diffusers

    from .wrap import _verbs as verbs

    index = _index(folder)
    cls = pipeline_class or getattr(diffusers, index["_class_name"], None)
    if cls is None:
        raise ValueError(
            f"pager: from_pretrained({folder!r}): diffusers has no pipeline class {index['_class_name']!r} "
            "(an older diffusers?); give pipeline_class=."
        )
    given = {k: options.pop(k) for k in [k for k in options if k in index]}
    pool_given = pool is not None
    pool = _pool_of(budget, pool, options)
    kind = index["_class_name"]
    # (a model given by name, a transformer quantized by its caller, joins the pool as wrap(pipe) would wrap it)
    joining = [(n, m) for n, m in given.items() if isinstance(m, nn.Module)]
    mine = [(n, m) for n, m in joining if not joins(kind, n, m, pool, verbs().of)]
    built = {}  # (every model on meta first: the budget is checked before any is read)
    for name, model_cls in _model_classes(index, given):
        sub = os.path.join(folder, name)
        entries = open_checkpoint(sub)  # (refuses a subfolder without weights, naming what it looked for)
        built[name] = _on_meta(model_cls, sub, dtype or most_common_float(entries))
    check_room(kind, pool, [*built.items(), *mine], verbs(), given=pool_given)
    host = _host_shares(kind, options.pop("host_budget", None), built, {**options, "pool": pool})
    each = {k: options[k] for k in COMPONENT_OPTIONS if k in options}
    wrapped, made = WrappedPipeline(pool), []
    taken = {o.name for o in pool.engine.owners}
    try:
        for name, model in [*built.items(), *mine]:
            unique = free_name(name, taken)
            if name in built:
                load(model, os.path.join(folder, name), pool=pool, name=unique, host_budget=host[name], **options)
            else:
                verbs().wrap(model, pool=pool, name=unique, **each)
            taken.add(unique)
            made.append(model)
        pipe = cls.from_pretrained(folder, **built, **given)
    except BaseException:
        undo(made, verbs())
        raise
    for name, model in [*built.items(), *joining]:
        wrapped.names.append(name)
        wrapped.modules.append(model)
    register(pipe, wrapped)
    return pipe


def _host_shares(kind: str, host_budget, built: dict, options: dict) -> dict:
    """Each model's share of the pipeline's `host_budget` (None: every page
    read once and kept): a model whose pages are no more than two of its
    largest is held whole; each other gets two of its largest pages, and of
    the rest a share by its bytes. Refused, before anything is read, below
    what those need together."""
    if host_budget is None:
        return dict.fromkeys(built)
    total = parse_host_budget(host_budget)
    pages = {n: page_bytes(m, options, own_budget=True) for n, m in built.items()}
    whole = {n: sum(p) for n, p in pages.items()}
    # (a host budget's memory is pinned in DIRECT_ALIGN multiples: each share is one)
    least = {n: align_up(min(2 * max(p, default=0), whole[n])) for n, p in pages.items()}
    spare = total - sum(least.values())
    if spare < 0:
        each = ", ".join(f"{n} {format_bytes(b)}" for n, b in least.items())
        raise ValueError(
            f"pager: host_budget={format_bytes(total)} is less than this {kind}'s models need in host memory "
            f"together ({each}: two of each one's largest pages, one read while another is copied to the "
            f"device, or the whole of a smaller model). Give host_budget of at least "
            f"{format_bytes(sum(least.values()), up=True)}."
        )
    paged = [n for n in built if least[n] < whole[n]]
    rest = sum(whole[n] for n in paged) or 1
    shares = {n: least[n] + spare * whole[n] // rest // DIRECT_ALIGN * DIRECT_ALIGN for n in paged}
    return {n: shares[n] if n in shares and shares[n] < whole[n] else None for n in built}


def _index(folder: str) -> dict:
    with open(os.path.join(folder, "model_index.json")) as f:
        index = json.load(f)
    if not isinstance(index, dict) or "_class_name" not in index:
        raise ValueError(f"pager: {folder!r}/model_index.json names no pipeline class (_class_name).")
    return index


def _pool_of(budget, pool, options: dict) -> Pool:
    if pool is not None:
        if budget is not None or any(k in options for k in POOL_OPTIONS):
            raise ValueError("pager: give budget= (with device=, pin=) or pool=, not both.")
        return pool
    if budget is None:
        raise ValueError('pager: from_pretrained of a pipeline needs budget= (e.g. budget="8GiB") or pool=.')
    return Pool(budget, **{k: options.pop(k) for k in POOL_OPTIONS if k in options})


def _model_classes(index: dict, given: dict) -> list:
    """(name, class) of the index's model components (`nn.Module` classes), those given excepted."""
    out = []
    for name, spec in index.items():
        if name.startswith("_") or name in given or not isinstance(spec, list) or len(spec) != 2 or None in spec:
            continue
        library, class_name = spec
        try:
            module_cls = getattr(importlib.import_module(library), class_name)
        except (ImportError, AttributeError):
            continue  # (diffusers says which it cannot load, as it would)
        if isinstance(module_cls, type) and issubclass(module_cls, nn.Module):
            out.append((name, module_cls))
    return out


def _on_meta(model_cls, folder: str, dtype: torch.dtype) -> nn.Module:
    """`model_cls` built from `folder`'s configuration, its parameters on
    meta: diffusers' (`load_config`, `from_config`; its buffers computed on
    the CPU as it is built: diffusers' modules keep no configuration to build
    them again from, [Note: buffers a checkpoint does not hold] in
    api/buffers.py) or transformers' (`AutoConfig`, `_from_config`, on meta)."""
    if hasattr(model_cls, "load_config"):
        with _parameters_on_meta():
            model = model_cls.from_config(model_cls.load_config(folder))
        model.to(dtype)
    else:
        import transformers

        config = transformers.AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = model_cls._from_config(config, dtype=dtype)
    return model.eval()


@contextmanager
def _parameters_on_meta():
    """Modules built in it put each parameter on meta as it is registered
    (one host allocation at a time, uninitialised, let go at once); their
    buffers are made where they would be (accelerate's `init_empty_weights`
    with `include_buffers=False`, which diffusers loads with)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]  # (for the build only: accelerate's way)
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
