"""Shared helpers: sizes worked out from the model, and equality checks."""

from __future__ import annotations

import contextlib
import threading
import traceback

import torch

import pager
from pager.base.block import align


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


@contextlib.contextmanager
def reading_in_a_thread(tensors, check):
    """Another thread calls `check(t)` on each of `tensors`, over and over,
    while the body runs. Yields a dict: 'reads' counted, 'errors' (tracebacks)."""
    done, log = threading.Event(), {"reads": 0, "errors": []}

    def reader():
        try:
            while not done.is_set():
                for t in tensors:
                    check(t)
                    log["reads"] += 1
        except Exception:  # noqa: BLE001 - reported to the test
            log["errors"].append(traceback.format_exc())

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        yield log
    finally:
        done.set()
        thread.join()


def run_threads(target, n):
    """Run `target(i)` on `n` threads at once; return the exceptions they raised."""
    errors = []

    def guarded(i):
        try:
            target(i)
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def hooked_blocks(model) -> int:
    """The model's blocks with pager's forward hooks on: none while the pager sleeps ([Note: asleep])."""
    return sum(bool(b.hook_handles) for b in pager.of(model).blocks)


def streamed_llama(hidden: int, device):
    """A 6-layer `LlamaForCausalLM` (random weights, `hidden` wide), a copy
    of it on `device`, and a budget of its remainder and 3 layers: decode
    streams layers across token boundaries. Skips without transformers."""
    import copy

    import pytest

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ref = copy.deepcopy(model).to(device)
    layer = tensor_page_bytes(model.model.layers[0])
    return model, ref, tensor_page_bytes(model) - 3 * layer  # (the remainder and 3 of the 6 layers)
