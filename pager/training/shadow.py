"""A shadow of an optimizer: its update over parameters and state that pager
chooses, touching nothing else the user holds ([Note: deferred updates] in
training/optim.py)."""

from __future__ import annotations

import collections


def shadow_of(optimizer, groups: list, state=None):
    """An object of `optimizer`'s class that shares its attributes but has
    `groups` (and `state`) of its own, and none of its hooks: a step of it
    touches nothing the user holds but the state entries given, and a
    hooked step that its own step calls (a subclass's `super().step()`)
    does not come back to pager."""
    shadow = object.__new__(type(optimizer))
    shadow.__dict__.update(optimizer.__dict__)
    shadow.param_groups = groups
    if state is not None:
        shadow.state = state
    shadow._optimizer_step_pre_hooks = collections.OrderedDict()
    shadow._optimizer_step_post_hooks = collections.OrderedDict()
    shadow._pager_shadow = True  # (not attached by the global hook)
    return shadow
