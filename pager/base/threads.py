"""Which Python threads may use a model's tensors ([Note: threads that are
not users]); the answer puts a pager in the shared mode ([Note: tensors and
threads] in base/served.py)."""

from __future__ import annotations

import inspect
import sys
import threading
import weakref
from concurrent.futures import thread as _futures_thread

from .common import WORKER_PREFIX

# [Note: threads that are not users]
# With a second thread about, a pager keeps its blocks guarded while they are
# in use, and opens them only to the threads that pinned them: slower, and
# under `torch.compile` every op on a guarded weight is a graph break (which
# also changes inductor's fusions, so results differ in the last bits from
# the model compiled unwrapped). So threads known never to touch a model's
# tensors do not count:
# - pager's own workers (named with WORKER_PREFIX);
# - tqdm's monitor, started with the first progress bar (transformers'
#   `save_pretrained`, inductor's compile) and kept for the process;
# - torch's own, which run compilers and batches, never a user's function:
#   inductor's compile pool (a ThreadPoolExecutor that `AsyncCompile` keeps
#   once a graph has compiled), threads whose target is a function of
#   inductor's (its subprocess pool's reader), and a DataLoader's pin-memory
#   thread (it pins batches; the most common second thread in training).
#   Only those modules: a thread whose target is other torch code (`torch.save`
#   of a state dict, `opt.step`, a module's forward) may well read weights.
# Anything else counts, the user's own thread pools included: a thread we
# cannot place is a possible user, and the shared mode is the safe answer.
# (This thread is found by its id, not `current_thread()`, which would make a
# lasting dummy Thread for a thread Python did not start, as autograd's
# device threads are, that every later look would count.)
# A thread found harmless is remembered (weakly), so a use that finds the
# same threads again does not look at them again.
_HARMLESS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_TORCH_THREAD_MODULES = ("torch._inductor.", "torch.utils.data._utils.pin_memory")


def other_threads() -> bool:
    """Whether a Python thread besides this one exists that may use a
    model's tensors (see the Note)."""
    if threading.active_count() == 1:
        return False
    me = threading.get_ident()
    for t in threading.enumerate():
        if t.ident == me or t in _HARMLESS:
            continue
        if not not_a_user(t):
            return True
        _HARMLESS.add(t)
    return False


def not_a_user(t: threading.Thread) -> bool:
    """Whether `t` is a thread known never to touch a model's tensors (see the Note)."""
    if t.name.startswith(WORKER_PREFIX):
        return True
    if t.name == "tqdm_monitor" and type(t).__name__ == "TMonitor":
        return True
    target = getattr(t, "_target", None)  # (Thread's own attribute, kept while it runs)
    if inspect.isroutine(target):
        module = getattr(getattr(target, "__func__", target), "__module__", None) or ""
        if module.startswith(_TORCH_THREAD_MODULES):
            return True
    return target is _futures_thread._worker and _in_torch_pool(t)


def _in_torch_pool(t: threading.Thread) -> bool:
    """Whether `t` is a worker of inductor's compile pool (without making
    the pool where none was made)."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    pool = getattr(getattr(async_compile, "AsyncCompile", None), "pool", None)
    cache_info = getattr(pool, "cache_info", None)
    if pool is None or cache_info is None or cache_info().currsize == 0:
        return False
    return t in getattr(pool(), "_threads", ())
