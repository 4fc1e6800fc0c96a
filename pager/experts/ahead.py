"""The next mixture layer's experts, fetched while this one computes.

[Note: experts fetched ahead]
A decode token's routed experts are known only once its layer's router has
run; copied then, they hold up the layer (1.60x all on the GPU for a
Qwen3-30B-A3B-shaped model under 8 GiB where routing is uniform: every
token's experts miss). A layer's routing is much like what the next layer's
router would choose from this layer's input: the residual stream changes
little from one layer to the next (the predictor of mixtral-offloading and
pre-gated MoE). So when a call's routing has reached the host (one copy: the
host waits for it anyway), its hidden states come too (a token's is a few
KB) and the next experts module's router is applied to them on the host; the
experts it would choose that the cache lacks are copied into slots on a
side stream at once, while this layer's experts and the next layer's
attention run. The next call waits for that copy (an event) only where it
uses one of them; an expert predicted wrongly costs its copy and a slot.

A prediction that misses costs: on the H200, where the routing is drawn at
random (no router can predict it), fetching ahead at chance took a
Qwen3-30B-A3B-shaped decode from 32.8 to 58.3 ms a token (16 layers, 8 GiB
scaled): 6% of the experts copied ahead were used, and they pushed used
ones out of the cache. So each cache judges it by windows of experts copied
ahead (`ExpertCache._judge_ahead`): where fewer than half of a window's
were used, it stops for 4096 calls, then tries again.

Only for calls of few tokens (decode: `MOST_TOKEN_ROUTES`), where a layer
routes to few of its experts; a prefill routes to nearly all of them. Only
where the next module shares this one's cache (one layout), so that a call
holds one cache's lock. The router's weights are read on the host from the
next module's own first call (its layer's block is on the device then) and
again when their version changes: a prediction is a hint, so a stale one
costs misses, never a wrong result.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn as nn

MOST_TOKEN_ROUTES = 1 / 2  # predict where a call's tokens x k are at most this share of the experts


def router_of(parent: nn.Module | None, experts: nn.Module, num_experts: int) -> nn.Module | None:
    """The router beside `experts` in `parent` (its MoE block): the other
    child with a 2-D `weight` of one row per expert."""
    if parent is None:
        return None
    for child in parent.children():
        w = getattr(child, "weight", None)
        if child is not experts and isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == num_experts:
            return child
    return None


class Router:
    """A host copy of an experts module's router, to predict its routing.

    Args:
        module: the router (`mlp.gate`, GPT-OSS's `mlp.router`).

    Example (inside pager):
        >>> router = Router(layer.mlp.gate)
        >>> router.refresh()  # in its module's own call: its weights are on the device then
        >>> router.predict(hidden_host, k=8)  # the experts it would choose, sorted
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.weight: torch.Tensor | None = None  # [E, H] float32, on the host
        self.bias: torch.Tensor | None = None
        self._version = -1

    def refresh(self) -> None:
        """Read the router's weights if they are new (its layer's block is in use)."""
        w = cast(torch.Tensor, self.module.weight)
        if w._version == self._version and self.weight is not None:
            return
        with torch.no_grad():
            # (copies: a view of a block's weights kept here would keep the block)
            self.weight = w.detach().to("cpu", torch.float32, copy=True).t().contiguous()
            bias = getattr(self.module, "bias", None)
            # (DeepSeek-V3's routers choose by their scores plus this correction)
            correction = getattr(self.module, "e_score_correction_bias", None)
            extra = [t.detach().to("cpu", torch.float32, copy=True) for t in (bias, correction) if t is not None]
            self.bias = sum(extra[1:], extra[0]) if extra else None
        self._version = w._version

    def predict(self, hidden: torch.Tensor, k: int) -> list:
        """The experts the router would choose for `hidden` (tokens x H, on the host), sorted and unique."""
        assert self.weight is not None
        logits = hidden.reshape(-1, self.weight.shape[0]).float() @ self.weight
        if self.bias is not None:
            logits += self.bias
        return sorted(set(logits.topk(k, dim=-1).indices.reshape(-1).tolist()))


def predict_next(table, hidden: torch.Tensor, k: int) -> list | None:
    """The experts the router of the experts module after `table`'s
    (an `ExpertTable`) would choose for `hidden`, where they are to be
    fetched ahead (see the Note)."""
    nxt = table.next
    if nxt is None or nxt.router is None or nxt.router.weight is None or table.cache.ahead_paused:
        return None
    if hidden.numel() // hidden.shape[-1] * k > MOST_TOKEN_ROUTES * nxt.num_experts:
        return None  # (many tokens: a layer routes to most of its experts)
    return nxt.router.predict(hidden.detach().cpu(), k)


def fetch_ahead(table, predicted: list, experts: list) -> None:
    """Copy the `predicted` experts of the module after `table`'s into the
    shared cache now, on its side stream; never a slot of `experts`, the
    call's (see the Note)."""
    nxt, cache = table.next, table.cache
    taken = cache.take_ahead(nxt.base, predicted, protect={table.base + e for e in experts})
    if not taken:
        return
    side = cache.ahead_stream
    try:
        if side is None:  # (the CPU device: copied now)
            for slot, key in taken:
                nxt.fill(slot, key)
        else:
            # Slots taken may still be read by the compute stream's kernels so far.
            side.wait_stream(torch.cuda.current_stream(cache.device))
            with torch.cuda.stream(side):
                for slot, key in taken:
                    nxt.fill(slot, key)
                event = cache.ahead_event = cache.ahead_event or torch.cuda.Event()
                event.record()
    except BaseException:
        cache.drop([key for _slot, key in taken])  # (not all filled: none held)
        raise
    counters = table.pager.counters
    counters.expert_ahead += len(taken)
    counters.expert_h2d_bytes += len(taken) * nxt.expert_bytes
