"""State dicts of a paged model, and putting everything back (unwrap)."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..base import guards, wrappers
from ..base.block import Block
from ..base.common import WEIGHTS, model_hook
from .grads import PagedOutGrad, replay


class StateDicts:
    """`state_dict()` / `load_state_dict()` of one wrapped model: host copies
    out, fetches in.

    Args:
        pager: the model's `Pager` (used through its public methods).

    [Note: state dicts of a paged model]
    Module.state_dict() returns references to the tensors, and a paged-out
    block's tensors have no memory behind them; a post-hook on the root
    replaces every paged entry with a host copy of its current value (so a
    checkpoint needs no room on the device and loads without a GPU).
    load_state_dict() copies into the tensors in place: a pre-hook on each
    block module fetches the block, a post-hook releases it, and the copies
    bump the version counters, so the block is written back when it leaves.
    """

    def __init__(self, pager):
        self.pager = pager
        self._names: dict = {}  # state-dict name -> (segment, slot) of every paged tensor

    def install(self) -> list:
        """Install the hooks; returns their handles."""
        pager, model = self.pager, self.pager.model
        index = {
            id(t): (seg, i)
            for block in pager.all_blocks()
            for seg in block.weight_segments
            for i, t in enumerate(seg.tensors)
        }
        index.update(
            (id(w), (seg, w)) for block in pager.all_blocks() for seg in block.weight_segments for w in seg.wrappers
        )  # (a quantized weight: rebuilt from its inner tensors' entries)
        named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
        self._names = {n: index[id(t)] for n, t in named if id(t) in index}
        post = getattr(model, "register_state_dict_post_hook", None) or model._register_state_dict_hook
        handles = [post(lambda *a: self._state_dict_post(*a))]
        # (hooks a block keeps while asleep: [Note: a wrapped model is not pickled or copied])
        for block in pager.blocks:
            handles.append(_load_pre_hook(block.module, model_hook(self._make_load_pre(block), traced=True)))
            post_hook = model_hook(self._make_load_post(block), traced=True)
            handles.append(block.module.register_load_state_dict_post_hook(post_hook))
        return handles

    def _state_dict_post(self, module, state_dict, prefix, local_metadata):
        pager = self.pager
        keys = [(prefix + name, seg, i) for name, (seg, i) in self._names.items() if prefix + name in state_dict]
        for key, _seg, _i in keys:
            # The module's `param.detach()`, an alias of the page: dropped
            # before a deferred update exposes its block, for a live alias
            # makes a page dirty (a frozen one would be written back).
            state_dict[key] = None
        with pager.lock:
            pager.apply_deferred()  # the weights as the steps taken so far left them
            if pager.transport.is_cuda:
                torch.cuda.synchronize(pager.device)  # write-backs in flight must land first
            views = {}  # segment -> its current values (a compressed page decodes once)
            for key, seg, i in keys:
                with guards.unguarded():
                    if seg not in views:
                        views[seg] = seg.current_views()
                    state_dict[key] = _host_copy(seg, views[seg], i)

    def _make_load_pre(self, block: Block):
        def load_pre(module, state_dict, prefix, *args):
            with self.pager.lock:
                self.pager.uses.acquire(block, WEIGHTS, record=False)

        return load_pre

    def _make_load_post(self, block: Block):
        def load_post(module, incompatible_keys):
            with self.pager.lock:
                self.pager.uses.release(block)
                if self.pager.owners is not None:
                    self.pager.owners.loaded(block)  # ([Note: block owners])

        return load_post


def _load_pre_hook(module: nn.Module, hook):
    public = getattr(module, "register_load_state_dict_pre_hook", None)
    if public is not None:
        return public(hook)
    return module._register_load_state_dict_pre_hook(hook, with_module=True)


def _host_copy(seg, views: list, i) -> torch.Tensor:
    """A host copy of tensor `i` of `seg` (its index, or a quantized weight of
    it: a wrapper of copies of its inner tensors) from the segment's `views`."""
    if isinstance(i, int):
        return views[i].detach().to("cpu", copy=True)
    at = {id(t): k for k, t in enumerate(seg.tensors)}
    return wrappers.copy_on(
        i, {n: views[at[id(inner)]] for n, inner in wrappers.inner_tensors(i)}, "cpu", guards.unguarded_class(i)
    )


def _restore(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.detach().to(device, copy=True)


def close(pager) -> None:
    """Put every tensor back on its original device with its current value."""
    pager.apply_deferred()
    pager.host_steps.close()
    if pager.transport.is_cuda:
        torch.cuda.synchronize(pager.device)  # unwrap is not a hot path: settle all copies
    pager.hooks.remove()
    for block in pager.blocks:
        pager.direct_calls.unguard(block)
        for h in block.hook_handles:
            h.remove()
        block.hook_handles = []
    for block in pager.all_blocks():
        for seg in block.segments.values():
            guards.release(seg)  # tensors get their own class back; views handed out are told
    for table in pager.row_tables:
        table.restore([link.optimizer for link in pager.optimizers])
    for experts in pager.expert_tables:
        experts.restore([link.optimizer for link in pager.optimizers])
    pager.expert_tables = []  # (their caches' device memory goes with them)
    if pager.row_stream is not None:
        pager.row_stream.writer.close()
    for opt_link in list(pager.optimizers):  # detach() removes the link from the list
        opt_link.detach()
    for block in pager.all_blocks():
        tensors = [t for w in block.weight_segments for t in w.tensors]
        views = [v for w in block.weight_segments for v in w.current_views()]
        values = [_restore(v, pager.original_device[id(t)]) for v, t in zip(views, tensors)]
        grads = block.segments.get("grads")
        grad_values = []
        if grads is not None:
            host = grads.host_views()
            for i, p in enumerate(grads.params):
                g = p.grad
                if isinstance(g, PagedOutGrad):
                    value = host[i].clone()
                    replay(value, g.segment.pending.get(i, ()))
                    grad_values.append((p, value))
                elif g is not None:
                    grad_values.append((p, g))
        for t, v in zip(tensors, values):
            t.data = v
        for seg in block.weight_segments:
            for w in seg.wrappers:  # back onto the original device, around their inner tensors
                wrappers.follow_inner(w)
        for p, g in grad_values:
            p.grad = _restore(g, p.device)
    pager.engine.leave(pager)  # everything above holds its own copy now
    pager._closed = True
