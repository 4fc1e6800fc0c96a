"""The state an optimizer's first update of a block makes on the device,
moved into the block's `state` page: `adopt_state` ([Note: the streamed
step] in training/optim.py), through host memory where the page does not
fit beside it ([Note: the step's room] in training/step_room.py)."""

from __future__ import annotations

import logging
from operator import is_not

import torch

from ..base.block import Block, layout

log = logging.getLogger("pager")


def adopt_state(link, block: Block) -> bool:
    """Move the state `link`'s optimizer (an `OptimizerLink`'s) created on
    the device for `block` into the block's page; True where it went
    through host memory (`_stage_state`)."""
    opt_state = link.optimizer.state
    seg = block.segments.get("state")
    if seg is not None:
        # Entries the optimizer replaced (rather than updated in place) go back into the page.
        values = [opt_state[p].get(key) for p, key in seg.keys]
        if any(map(is_not, values, seg.tensors)):
            for (p, key), value, view in zip(seg.keys, values, seg.tensors):
                if value is not view and isinstance(value, torch.Tensor):
                    view.copy_(value)
                    opt_state[p][key] = view
        return False
    keys = device_state(link.optimizer, link.pager, block)
    if not keys:
        return False
    pager = link.pager
    room = pager.engine.room
    nbytes = layout([(key, opt_state[p][key]) for p, key in keys])[1]
    # (the new state beside it is held out of the room: [Note: the step's room])
    staged = not room.make_room(nbytes, protect={block})
    aside = staged and block.owner in pager.engine.host.disks  # (a disk tier places pages when first written)
    if aside:
        _set_aside(link, keys)
        if not room.make_room(nbytes, protect={block}):
            room.raise_no_room(block, nbytes)  # (before a page is made: the state is the optimizer's, in host memory)
    seg = pager.new_segment(block, "state", [(f"{id(p)}.{key}", opt_state[p][key]) for p, key in keys])
    seg.keys = keys
    if staged and not aside:
        _stage_state(link, block, seg)
        if not room.make_room(seg.nbytes, protect={block}):
            room.raise_no_room(block, seg.nbytes)  # (the state is in its page: fetched when next needed)
    # Allocated like any fetch (a new page holds nothing yet, so nothing is
    # copied), and compute waits before filling it from the optimizer's state.
    pager.engine.fetch(block, ("state",))
    pager.engine.wait(block)
    pager.uses.expose(block)  # the block is in use: its new state tensors too
    block.settled = True  # (as its acquire left it: compute waited, so the next forward may run asleep)
    if not staged or aside:
        with torch.no_grad():
            for (p, key), view in zip(keys, seg.tensors):
                view.copy_(opt_state[p][key])  # (from the device, or the copy set aside in host memory)
                opt_state[p][key] = view
    seg.host_valid = True  # the copies above made it dirty: written back when it leaves
    return staged


def _set_aside(link, keys: list) -> None:
    """No room for a new state page beside the state, and no host page to
    stage it in (a disk tier's is placed when first written): the state is
    copied to host memory of its own and the device's let go; the page,
    once there is room, is filled from it."""
    opt_state = link.optimizer.state
    freed = 0
    for p, key in keys:
        value = opt_state[p][key]
        opt_state[p][key] = value.to("cpu", copy=True)
        freed += value.untyped_storage().nbytes()
    link.step_room.adopted(freed)


def _stage_state(link, block: Block, seg) -> None:
    """No room for `block`'s new state page beside the state the
    optimizer just made ([Note: the step's room]): the state goes to the
    page's host memory first, the optimizer's tensors are let go, and the
    page is then fetched as any other."""
    opt_state = link.optimizer.state
    freed = 0
    with torch.no_grad():
        for (p, key), host, view in zip(seg.keys, seg.host_views(), seg.tensors):
            value = opt_state[p][key]
            host.copy_(value)  # (synchronous: the page holds it before the fetch reads it)
            freed += value.untyped_storage().nbytes()
            opt_state[p][key] = view  # (paged out until the fetch below)
    seg.host_valid = True
    link.step_room.adopted(freed)
    log.debug("pager: %s's new optimizer state went through host memory (no room beside it)", block.name)


def device_state(optimizer, pager, block: Block) -> list:
    """(parameter, key) of each state tensor `optimizer` holds on the device for `block`."""
    return [
        (p, key)
        for p in block.params
        for key, value in optimizer.state.get(p, {}).items()
        if isinstance(value, torch.Tensor) and value.device == pager.device and value.numel() > 0
    ]


def fresh_state_bytes(optimizer, pager, block: Block) -> int:
    """Bytes of the state `optimizer` holds on the device for `block` outside
    its page (made by its first update, not yet adopted)."""
    if "state" in block.segments:
        return 0
    return sum(optimizer.state[p][key].untyped_storage().nbytes() for p, key in device_state(optimizer, pager, block))
