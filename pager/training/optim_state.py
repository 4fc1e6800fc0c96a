"""The optimizer's state as the user's `state_dict()`, `load_state_dict()`
and `unwrap` see it, while its tensors are views of the blocks' state pages
(`StateDictHooks`, one per attached optimizer, held by its `OptimizerLink`)."""

from __future__ import annotations

import torch

from ..base import guards
from . import masters


class StateDictHooks:
    """The optimizer's state_dict hooks: its paged entries read and written
    through host copies; `give_back` at `unwrap`."""

    def __init__(self, pager, optimizer):
        self.pager = pager
        self.optimizer = optimizer
        self._swapped: list = []  # (parameter, key, its view) swapped for a host copy during state_dict()
        self._loaded_float32: dict = {}  # ([Note: master weights] in training/masters.py)
        self.handles = [
            optimizer.register_state_dict_pre_hook(self._before_state_dict),
            optimizer.register_state_dict_post_hook(self._after_state_dict),
            optimizer.register_load_state_dict_pre_hook(self._before_load_state_dict),
            optimizer.register_load_state_dict_post_hook(self._after_load_state_dict),
        ]

    def give_back(self) -> None:
        """The optimizer's state as ordinary tensors on the parameters' devices
        (under master weights: as torch's update of a bf16 parameter keeps it)."""
        pager = self.pager
        for block in pager.all_blocks():
            seg = block.segments.get("state")
            if seg is None:
                continue
            for (p, key), value in zip(seg.keys, seg.current_views()):
                st = self.optimizer.state.get(p)
                if st is not None and key in st:
                    st[key] = value.detach().to(pager.original_device[id(p)], copy=True)
        if pager.master_weights:
            for p in list(self.optimizer.state):
                if masters.MASTER in self.optimizer.state[p]:
                    self.optimizer.state[p] = masters.narrowed(self.optimizer.state[p], p.dtype)

    def _before_state_dict(self, optimizer) -> None:
        # Optimizer.state_dict() returns references to the state tensors, and a
        # paged-out block's have no memory behind them: for the duration of the
        # call, every paged entry is a host copy of its current value.
        pager = self.pager
        pager.apply_deferred()
        if pager.transport.is_cuda:
            torch.cuda.synchronize(pager.device)
        self._swapped = []
        for block in pager.all_blocks():
            seg = block.segments.get("state")
            if seg is None:
                continue
            for (p, key), value in zip(seg.keys, seg.current_views()):
                self._swapped.append((p, key, optimizer.state[p][key]))
                with guards.unguarded():
                    optimizer.state[p][key] = value.detach().to("cpu", copy=True)

    def _after_state_dict(self, optimizer, state_dict):
        # The packed state holds the very dicts of optimizer.state: detach the
        # returned ones before the views go back in.
        state_dict["state"] = {k: dict(v) for k, v in state_dict["state"].items()}
        for p, key, view in self._swapped:
            optimizer.state[p][key] = view
        self._swapped = []
        if self.pager.owners is not None:  # (each rank holds its blocks' share: [Note: block owners])
            state_dict["state"] = self.pager.owners.gather_state(optimizer, state_dict["state"])
        return state_dict

    def _before_load_state_dict(self, optimizer, state_dict) -> None:
        pager = self.pager
        if pager.master_weights:  # (checked before anything changes)
            self._loaded_float32 = masters.saved_float32(optimizer, state_dict, masters.param_names(pager))
        # Updates still pending would otherwise run on the loaded state.
        pager.apply_deferred()

    def _after_load_state_dict(self, optimizer) -> None:
        # load_state_dict() replaced every state tensor with a new one (cast to
        # the parameter's device). Put the values into the pages.
        pager = self.pager
        kept, self._loaded_float32 = self._loaded_float32, {}
        masters.restore_float32(optimizer, kept)  # (torch cast them to the parameters' dtype)
        if pager.owners is not None:
            pager.owners.keep_own_state(optimizer)
        if pager.transport.is_cuda:
            torch.cuda.synchronize(pager.device)
        for block in pager.all_blocks():
            seg = block.segments.get("state")
            if seg is None:
                continue
            if seg.cache is not None and not seg.resident:
                seg.cache.page_in(seg)  # (the copies below change the page in host memory)
            with torch.no_grad(), guards.unguarded():
                for (p, key), target, view in zip(seg.keys, seg.current_views(), seg.tensors):
                    target.copy_(optimizer.state[p][key])
                    optimizer.state[p][key] = view
            if seg.resident:
                seg.force_dirty = True
            else:
                seg.host_valid = True
                if seg.cache is not None:
                    seg.cache.written(seg, None)
