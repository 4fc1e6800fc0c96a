"""One experts module paged by expert: `ExpertTable`.

[Note: experts paged one by one]
A mixture-of-experts layer routes each token to k of its E experts; a decode
token of a Qwen3-30B-A3B uses 8 of 128 in each layer. Paged with its layer,
every expert would cross the link at every token (4.83 GB a token where the
routed ones are 0.30 GB). So an experts module (experts/find.py says which)
is no block: its parameters (the fused `gate_up_proj` and `down_proj`,
every expert's along the first dimension) stay in host memory, page-locked
where they are on CUDA, and the same Parameter objects they always were; the
rest of its layer (attention, router, shared experts, norms) is a block as
before. Its forward, called with the routing, runs in three steps:

1. the pre-hook takes the experts the routing names (`top_k_index`; sorted
   and unique: on CUDA one host sync, for the list), puts those the device
   cache does not hold into slots of it, copied from their host tensors on
   the compute stream, and renumbers the routing;
2. the module's own forward runs on the device with its parameters' `.data`
   set, for the call, to the cache's tensors and `num_experts` to their
   number. Under transformers' `batched_mm` and `grouped_mm`
   implementations each token's experts are summed in its own routing
   order, whatever their numbers: they read the cache in place, the routing
   renumbered to slots (`grouped_mm` where the cache has no more slots
   than torch's grouped_mm takes groups, on CUDA: torch's CPU kernel rounds
   a row by its place in its input, on some CPUs, and the slots' order moves
   each expert's rows). Any other forward (`eager`, a module of one's own)
   may add a token's experts up in the order of their numbers, so it gets
   the routed experts copied out of the cache in the order of their
   numbers, and the routing renumbered to ranks: every result is equal bit
   for bit to the unpaged module's (on the CPU device);
3. the post-hook (always called) gives the parameters their host tensors and
   `num_experts` back.

A call whose forward reads the cache in place routed to more experts than
the cache holds (a prefill under a cache smaller than a layer's experts),
or any call whose forward would copy more of them than an eighth of the
budget (`batched_mm` copies each token's k experts: 16 tokens of a
Mixtral-8x7B-shaped model, 10.5 GiB; the compact call copies the routed
ones), gets no tokens in its forward; the post-hook runs the module's
forward itself on groups of tokens within both ([Note: groups of tokens]
in experts/chunks.py), and its output is theirs, each token's row its own:
bit for bit under `batched_mm` (a product per token and expert); under
`eager` and `grouped_mm` an expert's product over fewer rows may round
otherwise (torch's CPU matmul picks its kernel by the rows). The compact
call routed to more experts than the cache holds (and any call that trains
them) takes no slot: its copy is made from the host tensors, whole, so a
small cache splits neither a compact prefill nor a training call.

Which experts stay in the cache is [Note: which experts stay] in
experts/cache.py; the cache's bytes come out of the budget like a row
table's. The cache is shared by every experts module of one layout, and one
call at a time uses it (the cache's lock, taken by the pre-hook and given
back by the post-hook: another thread's call may not take slots this call's
kernels read): the parameters hold the cache's tensors only while a forward
runs. On CUDA, a call's copies into slots are ordered after the kernels of
the call before it that read the cache (an event, recorded at its end).
A call with gradients through its input (the experts frozen) gets the
compact copy, and what autograd saves of it is made again from the host for
the backward: [Note: a backward through paged experts] in experts/saved.py.
A call with gradients for the experts' own parameters gets it too, through
`ExpertsIn`, and their gradients and updates go by expert: [Note: experts
trained one by one] in experts/train.py.
"""

from __future__ import annotations

import sys
import threading
from typing import cast

import torch
import torch.nn as nn

from ..base.common import dry_running, model_hook
from ..engine.host import unregister_table
from .ahead import Router, fetch_ahead, predict_next
from .cache import ExpertCache
from .chunks import gather_tokens, token_groups
from .find import hidden_name, implementation_of, routing_name, weights_name
from .host import HostCall, split_cold
from .saved import SavedExperts
from .step import step_table, training_given_back
from .train import ExpertsIn, add_piece, check_trainable, copied_from_host

IN_PLACE = frozenset({"batched_mm", "grouped_mm"})  # transformers' implementations indifferent to expert numbers
GROUPED_MM_MOST_GROUPS = 1024  # torch's grouped_mm takes at most this many groups (experts)
# A call's copies of experts: at most this share of the budget (`_chunk_limits`);
# the backward of a call with gradients holds two such at once (the copy made
# again, and its gradient): twice the share is held out of blocks' room in a
# training step (model/step_needs.py).
MOST_COPIED_SHARE = 8


class ExpertTable:
    """One experts module whose experts page one by one.

    Args:
        pager: the model's `Pager`.
        name: the module's qualified name.
        module: the experts module (see experts/find.py).
        cache: the device slots for its layout, shared with other modules.
        base: the first of its keys in `cache` (an expert's key is `base + expert`).
        router: the router beside it (`mlp.gate`), if any: the module before it
            predicts its routing ([Note: experts fetched ahead] in experts/ahead.py).

    Example (inside pager; `wrap` makes one per experts module):
        >>> table = ExpertTable(pager, "model.layers.0.mlp.experts", experts, cache, base=0)
        >>> table.restore()  # at unwrap: the parameters on their original device
    """

    def __init__(self, pager, name: str, module: nn.Module, cache: ExpertCache, base: int, router=None):
        self.pager, self.name, self.module, self.cache, self.base = pager, name, module, cache, base
        self.router = Router(router) if router is not None else None  # (its own: read at its calls)
        self.next: ExpertTable | None = None  # the next experts module of the model, if it shares the cache
        self.names = [n for n, p in module._parameters.items() if p is not None]
        self.params: list[nn.Parameter] = [cast(nn.Parameter, module._parameters[n]) for n in self.names]
        self.num_experts: int = cast(int, module.num_experts)
        self.routing = routing_name(module)  # (the forward's second argument)
        self.hidden = hidden_name(module)  # (its first)
        self.weights = weights_name(module)  # (its third: the routing's weights)
        self.original_device = self.params[0].device
        self.expert_bytes = sum(p[0].numel() * p.element_size() for p in self.params)
        self.hosts, self._registered, self._adopted = [], [], []
        cuda = pager.transport.is_cuda
        try:
            for pname, p in zip(self.names, self.params):
                value = p.detach()
                host, registered = pager.arena.host_table(value, cuda, f"experts {name}.{pname}")
                self.hosts.append(host)
                self._registered.append(registered)
                self._adopted.append(host is value)  # (the user's own CPU tensor: it stays)
        except BaseException:
            for registered in self._registered:  # (nothing else changed yet)
                unregister_table(registered)
            raise
        self._restored = False
        self._versions = [p._version for p in self.params]
        for i, p in enumerate(self.params):
            pager.expert_params[id(p)] = (self, i)  # (stepped by pager: [Note: experts trained one by one])
        with torch.no_grad():
            for p, host in zip(self.params, self.hosts):
                p.data = host
        self._calls: dict = {}  # thread id -> its calls of this module under way (more than one: nested)
        self._chunked: tuple | None = None  # a call's (args, kwargs, in_kwargs) to run by chunks (`_run_chunks`)
        self._saved: SavedExperts | None = None  # a call's with gradients through its input (experts/saved.py)
        self._host: HostCall | None = None  # a call's cold experts the host computes (experts/host.py)
        self._handles = [
            # (outside compiled graphs, as pager's other hooks: [Note: a wrapped model is not pickled or copied])
            module.register_forward_pre_hook(model_hook(self._before), with_kwargs=True),
            module.register_forward_hook(model_hook(self._after), always_call=True),
        ]

    # ----------------------------------------------------------- a call
    def _before(self, module, args, kwargs):
        # Given back by `_after`, which torch calls however the call ends with
        # an `Exception` (a failure here included); one an interrupt ends
        # (KeyboardInterrupt) skips it: `interrupted` gives it back then.
        if dry_running():
            return None  # (a measure on fake tensors: the module runs on its parameters' stand-ins, every expert)
        self.cache.lock.acquire()
        tid = threading.get_ident()
        self._calls[tid] = self._calls.get(tid, 0) + 1
        try:
            return self._bring(args, kwargs)
        except BaseException as e:
            if not isinstance(e, Exception):
                self._host = None  # (nothing of the host's to add: the call did not run)
                self._after(module, args, None)
            raise

    def _bring(self, args, kwargs):
        in_kwargs = self.routing in kwargs
        index = self._routing_of(args, kwargs, in_kwargs)
        self._check_current()
        trained = self._trains()
        if trained or (torch.is_grad_enabled() and getattr(self._hidden_of(args, kwargs), "requires_grad", False)):
            # A backward through the experts to their input, or to their own
            # parameters, will follow ([Note: a backward through paged experts] in
            # experts/saved.py). Left by `_after`.
            self._saved = SavedExperts(self.hosts, self.pager.counters)
            self._saved.begin()
        experts, inverse = self._routed(index, timed=True)
        most_experts, most_tokens = self._chunk_limits(index.shape[-1])
        if len(experts) > most_experts or index.shape[0] > most_tokens:
            # More experts than the cache holds (a prefill under a small cache), or
            # copies of them beyond the budget's share: the forward runs on no
            # tokens (and device tensors), and `_after` runs it a chunk at a time.
            self._chunked = (args, kwargs, in_kwargs)
            # (one slot's views: what a forward with gradients saves of them is small; no gradient flows from them)
            self._set_values([value.narrow(0, 0, 1) for value in self.cache.tensors])
            setattr(self.module, "num_experts", 1)  # noqa: B010 (see `_place`)
            return gather_tokens(args, kwargs, index.shape[0], torch.zeros(0, dtype=torch.long))
        if self.router is not None:
            self.router.refresh()  # (its layer's block is in use: its weights are here)
        # (predicted before this call's misses are queued: the host copy of its
        # hidden states waits for the router only, as the routing's did)
        # (a call that trains the experts takes no slot: nothing to fetch ahead into)
        predicted = None if trained else predict_next(self, self._hidden_of(args, kwargs), index.shape[-1])
        if not torch.is_grad_enabled() and self.cache.cold.on:  # (a call with gradients: every expert on the device)
            split = self._split_cold(args, kwargs, experts, inverse, index)
            if split is not None:
                args, kwargs, experts, inverse = split
                if not experts:  # (every one the host's: the device's forward runs on no tokens)
                    if predicted:
                        fetch_ahead(self, predicted, [])
                    self._set_values([value.narrow(0, 0, 1) for value in self.cache.tensors])
                    setattr(self.module, "num_experts", 1)  # noqa: B010 (see `_place`)
                    return gather_tokens(args, kwargs, index.shape[0], torch.zeros(0, dtype=torch.long))
        routing = self._place(experts, inverse, index, per_token=index.shape[-1])
        if predicted:
            fetch_ahead(self, predicted, experts)
        return self._with_routing(args, kwargs, in_kwargs, routing)

    def _split_cold(self, args, kwargs, experts: list, inverse: torch.Tensor, index: torch.Tensor):
        """Where the host computes some of the call's cold experts ([Note:
        cold experts on the host] in experts/host.py): the call's arguments
        with their weights 0 on the device, the experts left to the device
        and their ranks; else None."""
        position = 2 if len(args) > 2 else None
        weights = args[2] if position else kwargs.get(self.weights) if self.weights else None
        split = split_cold(self.cache, self.base, experts, inverse, index, weights, self._hidden_of(args, kwargs))
        if split is None:
            return None
        self._host, keep, ranks, device_weights = split
        if position:
            args = (*args[:2], device_weights, *args[3:])
        else:
            kwargs = {**kwargs, self.weights: device_weights}
        return args, kwargs, keep, ranks

    def _place(self, experts: list, inverse: torch.Tensor, index: torch.Tensor, per_token: int = 0) -> torch.Tensor:
        """Hold `experts` in the cache (a compact call that trains them or
        is routed past the cache: copy them from the host, see the Note),
        give the parameters their device values and `num_experts` its count
        for this call, and return the routing `index` renumbered to them;
        `per_token`: the experts a token routes to (`ExpertCache.hold`)."""
        cache = self.cache
        if self._in_place():  # (never a call that trains them: it has gradients)
            slots = self._hold(experts, per_token)
            values, count, routing = cache.tensors, cache.capacity, torch.tensor(slots, dtype=torch.long)[inverse]
        else:
            if self._trains() or len(experts) > cache.capacity:  # (no slot taken: see the Note)
                values = copied_from_host(self.params, self.hosts, experts, self.cache.device, self.pager.counters)
            else:
                slot_index = torch.tensor(self._hold(experts, per_token), dtype=torch.long)
                values = self._gathered(slot_index.to(cache.device, non_blocking=True), experts)
            routing = inverse
            count = max(1, len(experts))  # (a call of no tokens: some forwards take no count of 0 experts)
            if not experts:  # (... nor 0 experts' tensors beside a count of 1: grouped_mm, which saves them)
                values = [t.new_zeros((1, *t.shape[1:])) for t in cache.tensors]
            if self._saved is not None:
                self._saved.add(values if experts else [], experts)
        self._set_values(values)
        setattr(self.module, "num_experts", count)  # noqa: B010 (an nn.Module attribute: typed as a submodule)
        return routing.view(index.shape).to(index.dtype).to(index.device, non_blocking=True)

    def _trains(self) -> bool:
        """This call makes gradients for the experts' own parameters."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.params)

    def _gathered(self, slot_index: torch.Tensor, experts: list) -> list:
        """The cache's rows `slot_index` (the experts `experts`), a copy per
        parameter; a trained one's through `ExpertsIn` ([Note: experts
        trained one by one] in experts/train.py)."""
        grad, counters = torch.is_grad_enabled(), self.pager.counters
        return [
            ExpertsIn.apply(
                p, lambda t=t: t.index_select(0, slot_index), lambda g, p=p: add_piece(p, experts, g, counters)
            )
            if grad and p.requires_grad
            else t.index_select(0, slot_index)
            for p, t in zip(self.params, self.cache.tensors)
        ]

    def _set_values(self, values: list) -> None:
        """The tensors the module's forward reads for this call: a frozen
        parameter's data; a trained one's entry in the module (the
        Parameter, its data on the host, is put back by `_give_back`)."""
        grad = torch.is_grad_enabled()
        with torch.no_grad():
            for name, p, value in zip(self.names, self.params, values):
                if p.requires_grad and grad:
                    self.module._parameters[name] = value  # (not a Parameter, for the call: see the Note in train.py)
                else:
                    p.data = value

    def _chunk_limits(self, k: int) -> tuple[int, int]:
        """The most experts and tokens one run of this module's forward may
        take: in place, the experts the cache holds; the compact call, as many
        as an eighth of the budget holds (beyond the cache's slots, from the
        host); `batched_mm`'s copies of each token's k experts, an eighth of
        the budget. A token alone always runs."""
        implementation = implementation_of(self.module)
        most_copied = self.pager.budget_bytes // MOST_COPIED_SHARE
        tokens = most_copied // max(1, k * self.expert_bytes) if implementation == "batched_mm" else sys.maxsize
        if self._in_place(implementation):
            return self.cache.capacity, max(1, tokens)
        # (on the CPU device grouped_mm's call runs whole where the cache holds it: see the Note)
        whole = self.cache.capacity if self._grouped_on_cpu(implementation) else 0
        return max(k, whole, most_copied // max(1, self.expert_bytes)), max(1, tokens)

    def _hidden_of(self, args, kwargs):
        """The call's hidden states (its first argument, by position or name)."""
        return args[0] if args else kwargs.get(self.hidden)

    def _with_routing(self, args, kwargs, in_kwargs: bool, routing: torch.Tensor):
        if in_kwargs:
            return args, {**kwargs, self.routing: routing}
        return (args[0], routing, *args[2:]), kwargs

    def _run_chunks(self, module: nn.Module) -> torch.Tensor:
        """The output of a call that routes to more experts than the cache
        holds: its forward run on groups of tokens whose experts it holds
        ([Note: groups of tokens] in experts/chunks.py; each token's output
        is its own: equal to the whole call's)."""
        args, kwargs, in_kwargs = cast(tuple, self._chunked)
        self._chunked = None
        index = kwargs[self.routing] if in_kwargs else args[1]
        tokens = index.shape[0]
        outs = []
        most_experts, most_tokens = self._chunk_limits(index.shape[-1])
        groups = token_groups(index.reshape(tokens, -1).cpu().numpy(), self.num_experts, most_experts, most_tokens)
        for group in groups:
            chosen = None if len(groups) == 1 else torch.tensor(group, dtype=torch.long)
            sub_args, sub_kwargs = gather_tokens(args, kwargs, tokens, chosen)
            sub_index = sub_kwargs[self.routing] if in_kwargs else sub_args[1]
            routing = self._place(*self._routed(sub_index), sub_index, per_token=sub_index.shape[-1])
            sub_args, sub_kwargs = self._with_routing(sub_args, sub_kwargs, in_kwargs, routing)
            outs.append(type(module).forward(module, *sub_args, **sub_kwargs))  # (no hooks: this is the call)
        if len(groups) == 1:
            return outs[0]
        order = torch.tensor([t for group in groups for t in group], dtype=torch.long)
        back = torch.empty_like(order)
        back[order] = torch.arange(tokens)  # (each token's row in the groups' outputs, one after another)
        out = torch.cat(outs)
        return out.index_select(0, back.to(out.device, non_blocking=True))

    def _routing_of(self, args, kwargs, in_kwargs: bool) -> torch.Tensor:
        """The call's routing, once the call is checked."""
        if self._calls[threading.get_ident()] > 1:
            raise RuntimeError(f"pager: the experts module {self.name!r} was called from inside its own forward.")
        check_trainable(self)
        if not in_kwargs and len(args) < 2:
            raise TypeError(f"pager: the experts module {self.name!r} was called without its routing ({self.routing}).")
        return kwargs[self.routing] if in_kwargs else args[1]

    def _routed(self, index: torch.Tensor, timed: bool = False) -> tuple[list, torch.Tensor]:
        """The experts `index` names, sorted and unique, and the rank of each
        of its entries among them, on the host: one copy of the routing
        (k integers a token) for all of it, rather than `torch.unique` on the
        device and the sync it makes, then another for its result. `timed`:
        a call's own routing, whose wait the cold experts' choice measures."""
        # (on CUDA, the host waits for the router here)
        routing = self.cache.cold.routing_of(index, self.base) if timed else index.reshape(-1).cpu()
        used, inverse = torch.unique(routing, sorted=True, return_inverse=True)
        experts = used.tolist()
        if experts and (experts[0] < 0 or experts[-1] >= self.num_experts):
            raise IndexError(
                f"pager: the routing of {self.name!r} names expert {experts[0] if experts[0] < 0 else experts[-1]}"
                f", out of its {self.num_experts} experts."
            )
        return experts, inverse

    def _hold(self, experts: list, per_token: int = 0) -> list:
        """The cache's slots of `experts`, the missing ones copied in."""
        cache = self.cache
        if cache.released_event is not None:
            # The slots about to be filled may still be read by the kernels
            # of the last call (on another thread's stream): they wait.
            torch.cuda.current_stream(cache.device).wait_event(cache.released_event)
        used_before = cache.ahead_used
        # (timed where no copy ahead is under way: a wait for it would count as the link's)
        start = cache.cold.fills_start(cache.device) if not cache.copying_ahead else None
        slots, missed = cache.hold(self.base, experts, self.fill, cache.wait_ahead, per_token)
        cache.cold.fills_end(start, cache.device, missed)
        counters = self.pager.counters
        counters.expert_ahead_used += cache.ahead_used - used_before
        counters.expert_hits += len(experts) - missed
        counters.expert_misses += missed
        counters.expert_h2d_bytes += missed * self.expert_bytes
        return slots

    def _after(self, module, args, output):
        tid = threading.get_ident()
        if dry_running() or not self._calls.get(tid):
            return None  # (a measure; or an earlier pre-hook failed: `_before` did not run, torch calls this anyway)
        try:
            if self._chunked is not None:
                output = self._run_chunks(module)
            if self.pager.transport.is_cuda:
                event = self.cache.released_event = self.cache.released_event or torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.cache.device))
            if self._host is not None and output is not None:  # (its products, the parameters on their host tensors)
                self._give_back()
                output = self._host.add_to(module, output, self.cache.cold, self.pager.counters)
        finally:
            if self._saved is not None:
                self._saved.end()
                self._saved = None
            self._give_back()
            self._chunked = self._host = None
            self._calls[tid] -= 1
            if not self._calls[tid]:
                del self._calls[tid]
            self.cache.lock.release()
        return output

    def _give_back(self) -> None:
        """The parameters on their host tensors, `num_experts` the module's own."""
        with torch.no_grad():
            for name, p, host in zip(self.names, self.params, self.hosts):
                self.module._parameters[name] = p
                p.data = host
        setattr(self.module, "num_experts", self.num_experts)  # noqa: B010 (see `_place`)

    def interrupted(self) -> None:
        """This thread's calls that an interrupt ended without their post-hook
        ([Note: a forward interrupted] in model/hooks.py, which pops their
        saved-tensor hooks with the frames above their block's): the
        parameters back on their host tensors, the cache's lock given back."""
        calls = self._calls.pop(threading.get_ident(), 0)
        if not calls:
            return
        self._give_back()
        self._chunked = self._saved = self._host = None
        for _ in range(calls):
            self.cache.lock.release()

    def fill(self, slot: int, key: int) -> None:
        """Copy the expert of `key` from its host tensors into `slot` (on the current stream)."""
        expert = key - self.base
        for cached, host in zip(self.cache.tensors, self.hosts):
            cached[slot].copy_(host[expert], non_blocking=True)

    def _in_place(self, implementation: str | None = None) -> bool:
        """The forward (under `implementation`, by default the module's)
        reads the cache's tensors in place (see the Note)."""
        implementation = implementation or implementation_of(self.module)
        if self._grouped_on_cpu(implementation):
            return False  # (torch's CPU kernel rounds a row by its place in the input: see the Note)
        return (
            self._saved is None
            and implementation in IN_PLACE
            and (implementation != "grouped_mm" or self.cache.capacity <= GROUPED_MM_MOST_GROUPS)
        )

    def _grouped_on_cpu(self, implementation: str | None) -> bool:
        """transformers' `grouped_mm` on the CPU device: the routed experts
        copied out in the order of their numbers, the call whole (see the Note)."""
        return implementation == "grouped_mm" and self.cache.device.type == "cpu"

    def _check_current(self) -> None:
        """Forget the cached experts if a parameter was written outside a
        forward (`load_state_dict`, an in-place change): the host tensors
        are the values; the cached copies would be stale."""
        versions = [p._version for p in self.params]
        if versions != self._versions:
            self.cache.forget(self.base, self.num_experts)
            self._versions = versions

    # ----------------------------------------------------------- training
    def step(self, index: int, optimizer, group_index: int, run_step) -> None:
        """Update the experts the gradient of parameter `index` covers (`step_table`)."""
        step_table(self, index, optimizer, group_index, run_step)

    # ----------------------------------------------------------- unwrap
    def restore(self, optimizers=()) -> None:
        """The parameters back on their original device with their current
        values (and `optimizers`' state of them, and their gradients); hooks
        removed. Once (again: nothing)."""
        if self._restored:
            return
        self._restored = True
        for h in self._handles:
            h.remove()
        for name, p in zip(self.names, self.params):
            self.module._parameters[name] = p  # (a call an interrupt ended may have left its copy there)
        self.cache.forget(self.base, self.num_experts)
        with torch.no_grad():
            for p, host, adopted, registered in zip(self.params, self.hosts, self._adopted, self._registered):
                with training_given_back(p, self.original_device, optimizers):
                    p.data = host if adopted else host.to(self.original_device, copy=True)
                unregister_table(registered)
                self.pager.expert_params.pop(id(p), None)
        self._registered = [None] * len(self.params)

    def device_bytes(self) -> int:
        return self.cache.device_bytes()

    def __repr__(self) -> str:
        return f"ExpertTable({self.name!r}, {self.num_experts} experts of {self.expert_bytes} bytes)"
