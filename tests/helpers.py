"""Shared helpers: sizes worked out from the model, and equality checks."""

from __future__ import annotations

import torch

from pager._host import align


def tensor_page_bytes(module: torch.nn.Module) -> int:
    """Bytes the weights page of `module` takes (each tensor aligned)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += align(t.numel() * t.element_size())
    return total


def assert_same(a, b, exact=True):
    if exact:
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:
        torch.testing.assert_close(a, b)


def assert_models_equal(m1, m2, exact=True):
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2
        assert_same(p1.cpu(), p2.cpu(), exact)
