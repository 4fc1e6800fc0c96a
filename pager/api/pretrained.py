"""`pager.from_pretrained`: a Hugging Face checkpoint folder, paged in one call."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from ..base.files import most_common_float, open_checkpoint
from .load import load


def from_pretrained(folder, budget=None, *, model_class=None, dtype=None, **options) -> nn.Module:
    """Build the model of a Hugging Face checkpoint folder (one written by
    `save_pretrained`: `config.json` and safetensors, sharded or not) on the
    meta device and page it from the folder's files: no copy of the model is
    ever built in host memory. The model comes back in eval mode, with the
    folder's generation config, ready for `generate()`. Needs `transformers`
    (not a dependency of pager).

    Args:
        folder: the checkpoint folder; or a diffusers pipeline's (a
            `model_index.json` there): every model component is built on meta
            and paged from its subfolder's files into one pool, diffusers
            loads the rest, and the pipeline comes back wrapped as by
            `pager.wrap(pipe, ...)` (`model_class`: the pipeline's class; a
            component's name as an option, `tokenizer=...`, goes to
            diffusers, and a model given so joins the pool; `host_budget`
            is the pipeline's, shared among its models). Needs diffusers
            then.
        budget: device bytes, as for `pager.wrap`.
        model_class: the transformers class to build (e.g.
            `transformers.AutoModelForSeq2SeqLM`); None: the first of the
            config's `architectures`, else `AutoModelForCausalLM`.
        dtype: the dtype of the model's parameters; None: the dtype most of
            the checkpoint's floating tensors have (pages hold the files'
            bytes as they are, so it must match them).
        **options: those of `pager.load` (host_budget, spill, blocks,
            prefetch, optimizer, activations, ...).

    Example:
        >>> model = pager.from_pretrained("Llama-3-8B/", budget="6GiB")
        >>> ids = tokenizer("Hello", return_tensors="pt").input_ids.cuda()
        >>> out = model.generate(ids, max_new_tokens=20)
    """
    if os.path.isfile(os.path.join(os.fspath(folder), "model_index.json")):  # (a diffusers pipeline)
        from .pipeline_load import pipeline_from_pretrained

        return pipeline_from_pretrained(os.fspath(folder), budget, pipeline_class=model_class, dtype=dtype, **options)
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "pager.from_pretrained needs transformers (pip install transformers); or build the "
            "model on the meta device yourself and call pager.load(model, folder, budget)."
        ) from None
    if _version(transformers.__version__) < (5, 17):
        raise ImportError(
            f"pager.from_pretrained needs transformers 5.17 or newer (the lowest it is tested with); "
            f"this is {transformers.__version__}: pip install -U transformers."
        )
    folder = os.fspath(folder)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(
            f"pager: from_pretrained({folder!r}): no config.json there; give the folder that "
            "save_pretrained wrote (or use pager.load with a model you build)."
        )
    config = transformers.AutoConfig.from_pretrained(folder)
    entries = open_checkpoint(folder)  # (refuses a folder without weights, naming what it looked for)
    if dtype is None:
        dtype = most_common_float(entries)
    cls = model_class or _class_of(transformers, config)
    with torch.device("meta"):
        # (Auto classes build through `from_config`; a model class through `_from_config`: both take the dtype)
        model = (
            cls.from_config(config, dtype=dtype)
            if hasattr(cls, "from_config")
            else cls._from_config(config, dtype=dtype)
        )
    model.eval()
    try:
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    except OSError:
        pass  # no generation_config.json: the one made from the config stays
    return load(model, folder, budget, **options)


def _version(text: str) -> tuple:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _class_of(transformers, config):
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM
