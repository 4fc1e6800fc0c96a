"""Tensor operations by what serving them needs of a paged-out tensor
([Note: paged-out tensors] in base/guards.py): answered from the tensor
object alone (metadata: no fetch), views that read no element (answered by a
guarded view), writes in place, foreach lists, reads that build no graph.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.utils._pytree import tree_leaves


def _names(kind, names):
    return {getattr(getattr(torch.Tensor, n), kind) for n in names if hasattr(torch.Tensor, n)}


# Answered from the tensor object alone: no fetch.
METADATA = (
    _names(
        "__get__",
        [
            "shape",
            "dtype",
            "device",
            "requires_grad",
            "grad",
            "is_leaf",
            "grad_fn",
            "_version",
            "layout",
            "ndim",
            "names",
            "is_cuda",
            "is_cpu",
            "is_meta",
            "is_sparse",
            "is_sparse_csr",
            "is_quantized",
            "is_mkldnn",
            "is_nested",
            "is_mps",
            "is_xpu",
            "retains_grad",
            "output_nr",
            "itemsize",
            "nbytes",
            "_backward_hooks",
            "_post_accumulate_grad_hooks",
            "name",
            "_cdata",
            "_grad",
            "_grad_fn",
        ],
    )
    | _names(
        "__set__",
        [
            "grad",
            "requires_grad",
            "_backward_hooks",
            "_post_accumulate_grad_hooks",
            "name",
            "_grad",
        ],
    )
    | {
        getattr(torch.Tensor, n)
        for n in [
            "size",
            "dim",
            "numel",
            "nelement",
            "stride",
            "storage_offset",
            "is_contiguous",
            "element_size",
            "get_device",
            "is_floating_point",
            "is_complex",
            "is_signed",
            "requires_grad_",
            "register_hook",
            "register_post_accumulate_grad_hook",
            "retain_grad",
            "__len__",
            "_is_view",
            "is_inference",
            "is_conj",
            "is_neg",
            "__dir__",
            "__hash__",
            "_fix_weakref",
        ]
        if hasattr(torch.Tensor, n)
    }
    | {
        torch.numel,
        torch.is_floating_point,
        torch.is_complex,
    }
    | {getattr(torch._C, n) for n in ["_group_tensors_by_device_and_dtype"] if hasattr(torch._C, n)}
)
DATA_SET = cast(Any, torch.Tensor.data).__set__  # (a descriptor: torch's stubs type `data` as a Tensor)
DATA_GETTER = cast(Any, torch.Tensor.data).__get__
GRAD_SETTERS = _names("__set__", ["grad", "_grad"])
# Views that read no element: answered without a fetch by a view that is
# itself guarded (and remembered with its segment, so it never dangles).
_VIEW_NAMES = [
    "detach",
    "view",
    "view_as",
    "t",
    "transpose",
    "swapaxes",
    "permute",
    "movedim",
    "unsqueeze",
    "squeeze",
    "expand",
    "expand_as",
    "narrow",
    "select",
    "unflatten",
    "as_strided",
    "unbind",
    "split",
    "chunk",
]
VIEWS = (
    _names("__get__", ["data", "T", "mT"])
    | {getattr(torch.Tensor, n) for n in _VIEW_NAMES if hasattr(torch.Tensor, n)}
    | {getattr(torch, n) for n in _VIEW_NAMES if hasattr(torch, n)}  # (torch has no view, expand as functions)
)


def tensors_of(args, kwargs) -> list:
    """The tensors among an operation's arguments. Flat ones directly (a
    pytree walk costs more than the operation it guards), nested ones through
    the pytree."""
    out = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    out.append(item)
                elif isinstance(item, (list, tuple, dict)):
                    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        elif isinstance(value, dict):
            return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return out


def is_foreach(func, args) -> bool:
    return (
        getattr(func, "__name__", "").startswith(("_foreach_", "_amp_foreach_"))
        and bool(args)
        and isinstance(args[0], (list, tuple))
    )


NUMPY: set = {torch.Tensor.numpy, torch.Tensor.__array__}


def writes_in_place(func) -> bool:
    """Does `func` write into its first argument? (By name, as torch names them.)"""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_DUNDERS


_IN_PLACE_DUNDERS = {
    "__setitem__",
    "__iadd__",
    "__isub__",
    "__imul__",
    "__itruediv__",
    "__ifloordiv__",
    "__imod__",
    "__ipow__",
    "__iand__",
    "__ior__",
    "__ixor__",
    "__ilshift__",
    "__irshift__",
}


# Reads that build no graph (and whose output would show the identity node).
NO_GRAPH = {
    "__repr__",
    "__format__",
    "__str__",
    "__reduce_ex__",
    "__deepcopy__",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__array__",
    "__len__",
    "__contains__",
    "tolist",
    "item",
    "numpy",
    "data_ptr",
    "untyped_storage",
    "equal",
    "allclose",
}
