"""A quantized weight as torchao makes them, written out here so the tests
need no torchao: a traceable wrapper subclass whose bytes are int8 values and
one float scale per group of columns, and whose `F.linear` dequantizes."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

aten = torch.ops.aten
GROUP = 8


class QuantizedWeight(torch.Tensor):
    @staticmethod
    def __new__(cls, qdata, scale, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype, device=qdata.device,
                                                   requires_grad=False)

    def __init__(self, qdata, scale, dtype):
        self.qdata, self.scale = qdata, scale

    def __tensor_flatten__(self):
        return ["qdata", "scale"], {"dtype": self.dtype}

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["qdata"], inner["scale"], ctx["dtype"])

    @classmethod
    def of(cls, w: torch.Tensor) -> "QuantizedWeight":
        n, k = w.shape
        groups = w.detach().float().reshape(n, k // GROUP, GROUP)
        scale = groups.abs().amax(-1).clamp_min(1e-8) / 127
        qdata = torch.round(groups / scale[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
        return cls(qdata, scale, w.dtype)

    def __repr__(self):
        return f"QuantizedWeight(qdata={self.qdata!r}, scale={self.scale!r})"

    def dequantize(self) -> torch.Tensor:
        n, k = self.qdata.shape
        return (self.qdata.float().reshape(n, k // GROUP, GROUP) * self.scale[..., None]).reshape(n, k).to(self.dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return F.linear(x, w.dequantize(), bias)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = args[0]
        if func in (aten.detach.default, aten.clone.default, aten._to_copy.default):
            return cls(func(w.qdata, *args[1:], **kwargs), func(w.scale, *args[1:], **kwargs), w.dtype)
        if func is aten.copy_.default:
            w.qdata.copy_(args[1].qdata)
            w.scale.copy_(args[1].scale)
            return w
        raise NotImplementedError(f"QuantizedWeight: {func}")


def quantize(model: nn.Module) -> nn.Module:
    """Every nn.Linear of `model` with a QuantizedWeight (frozen), in place."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(QuantizedWeight.of(m.weight), requires_grad=False)
    return model


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s tensors as pager pages them: the quantized weights' inner tensors, each aligned."""
    from pager.model.discover import aligned_bytes

    return sum(aligned_bytes(t) for t in list(model.parameters()) + list(model.buffers()))
