"""Where one layer's optimizer update on the host goes under
`master_weights=True`: the bf16 gradients converted to float32, torch's
fused AdamW on the float32 masters and moments, the masters rounded into
the bf16 weights, and the whole update as pager runs it (`masters.step_each`)
from this thread and from pager's host worker (`HostWorker`, the thread the
updates run on in training), there also with this thread running Python
meanwhile (the update's Python between its ops then waits for the GIL). The fused kernel alone on float32 gradients
is also what torchao's CPUOffloadOptimizer runs with float32 state. Host
memory only; pinned where CUDA is present, as pager's pages.

A layer of Llama-7B's shape by default (d=4096, ff=11008: 202M parameters,
3.2 GB of float32 master and moments).

    python -m benchmarks.bench_host_update [--d 4096] [--ff 11008] [--reps 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness import Row, environment, save
from pager.training import masters
from pager.training.host_step import HostWorker, host_threads
from pager.training.shadow import shadow_of

WORKLOAD = "one layer's AdamW update on the host, bf16 weights with float32 masters"


class Layer:
    """A decoder layer's weights (4 of d x d, 3 of ff x d): bf16 weights and
    gradients, float32 masters with AdamW state made by a first update."""

    def __init__(self, d: int, ff: int):
        shapes = [(d, d)] * 4 + [(ff, d)] * 3
        pin = torch.cuda.is_available()
        self.weights = [self._host(torch.randn(s).to(torch.bfloat16), pin) for s in shapes]
        self.grads = [self._host((torch.randn(s) * 1e-3).to(torch.bfloat16), pin) for s in shapes]
        self.masters = [w.float() for w in self.weights]
        self.scratch = torch.empty(max(m.numel() for m in self.masters))
        self.params = sum(m.numel() for m in self.masters)
        self.optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-5, fused=True)
        self.raw_step = torch.optim.AdamW.step.__wrapped__
        self.group = {**self.optimizer.param_groups[0], "params": self.masters, "fused": True, "foreach": False}
        self.state = {m: {} for m in self.masters}
        self.rounded = {id(m): (g, w) for m, g, w in zip(self.masters, self.grads, self.weights)}
        self.update()  # (makes the state)

    @staticmethod
    def _host(t: torch.Tensor, pin: bool) -> torch.Tensor:
        return t.pin_memory() if pin else t

    def update(self) -> None:
        """The whole update in three passes, as pager runs it on the CPU device."""
        masters.step_each(self.raw_step, shadow_of(self.optimizer, [self.group], self.state), self.rounded)

    def update_in_one_pass(self) -> None:
        """The whole update, as pager runs it on a CUDA run's host."""
        passes = masters.step_each(self.raw_step, shadow_of(self.optimizer, [self.group], self.state),
                                   self.rounded, one_pass=True)
        if passes != len(self.masters):
            raise RuntimeError("the one pass did not take these masters (its compile failed: see the log)")

    def convert(self) -> None:
        for g in self.grads:
            self.scratch[: g.numel()].view(g.shape).copy_(g)

    def kernel(self) -> None:
        """The fused kernel alone, on float32 gradients (the scratch's)."""
        for m in self.masters:
            m.grad = self.scratch[: m.numel()].view(m.shape)
        try:
            self.raw_step(shadow_of(self.optimizer, [self.group], self.state))
        finally:
            for m in self.masters:
                m.grad = None

    def round(self) -> None:
        for m, w in zip(self.masters, self.weights):
            w.copy_(m)


class OnWorker:
    """`fn` as a job of pager's host worker (what `HostWorker` runs)."""

    def __init__(self, fn):
        self.fn = fn

    def landed(self) -> bool:
        return True

    def run(self) -> float:
        start = time.perf_counter()
        self.fn()
        return time.perf_counter() - start


def on_worker_ms(worker: HostWorker, job: OnWorker, reps: int, busy: bool = False) -> float:
    """Best ms of `job` on `worker`, this thread waiting for it (`busy`:
    running Python meanwhile, as a training loop's own code may: the
    update's Python between its ops waits for the GIL)."""
    times = []
    for _ in range(reps + 1):  # (the first starts the thread)
        future = worker.submit(job)
        while busy and not future.done():
            pass
        times.append(future.result())
    return 1e3 * min(times)


def best_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--ff", type=int, default=11008)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    layer = Layer(args.d, args.ff)
    worker = HostWorker(host_threads() if torch.cuda.is_available() else 0)
    on_worker = OnWorker(layer.update)
    start = time.perf_counter()
    layer.update_in_one_pass()
    compile_s = time.perf_counter() - start
    one_pass = OnWorker(layer.update_in_one_pass)
    rows = [(f"whole update, this thread ({torch.get_num_threads()} threads)", best_ms(layer.update, args.reps)),
            (f"whole update, pager's host worker ({worker.threads or torch.get_num_threads()} threads)",
             on_worker_ms(worker, on_worker, args.reps)),
            ("whole update, pager's host worker, this thread busy in Python",
             on_worker_ms(worker, on_worker, args.reps, busy=True)),
            ("one pass, this thread", best_ms(layer.update_in_one_pass, args.reps)),
            ("one pass, pager's host worker", on_worker_ms(worker, one_pass, args.reps)),
            ("one pass, pager's host worker, this thread busy in Python",
             on_worker_ms(worker, one_pass, args.reps, busy=True)),
            ("part: gradients to float32", best_ms(layer.convert, args.reps)),
            ("part: fused AdamW on float32", best_ms(layer.kernel, args.reps)),
            ("part: masters rounded into the weights", best_ms(layer.round, args.reps))]
    worker.close()
    whole = rows[0][1]
    out = [Row(WORKLOAD, method, ms, ratio=ms / whole, reference="whole update, this thread",
               note=f"{layer.params / ms / 1e6:.2f} G parameters/s") for method, ms in rows]
    env = environment()
    env["params"] = f"{layer.params / 1e6:.0f}M (d={args.d}, ff={args.ff})"
    env["one_pass_first_call_s"] = round(compile_s, 1)  # (its compile, once per process)
    save(out, "bench_host_update", env)


if __name__ == "__main__":
    main()
