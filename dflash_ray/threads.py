"""CPU threads: how many torch uses in each kind of process. One place, chosen by measurement
(benchmarks/bench_threads.py on the two-core machine, quiet and beside one busy process; ms per unit of
each kind's real work, lower is better):

    kind        1 thread        2 threads (spinning waits, OpenMP's default)
    driver       459 | 557       262 | 2222    the demo target's training step: 4,096 tokens
    regenerate   429 | 455       427 | 1785    generate(): 32 rows x 64 new tokens
    target        19 |  16        12 |   32    a target actor's feature forward, one plan batch
    trainer      278 | 365       147 |  568    a drafter training step, one plan batch
    evaluate     651 | 694       721 | 2521    speculative + greedy decoding of one prompt

A second thread pays off on a quiet machine for large batches and costs 4x beside a busy process: its
OpenMP threads spin while they wait, burning the time slice their partner needs (sleeping waits,
OMP_WAIT_POLICY=PASSIVE, avoid that but lose the quiet gain: 430 | 634 for the driver's step). So:

    driver      the job's own compute (the demo target's training): as many threads as the cores other
                processes leave free, re-checked every few seconds while it trains (FreeCoreThreads):
                2 on the quiet machine, 1 beside a busy process; cluster.cpu_threads.driver=N fixes N
    regenerate, target, trainer, evaluate
                1 each: they run beside each other (two trainers and a target actor on two cores), or are
                no faster with two (regeneration's and decoding's small matmuls)

cluster.cpu_threads.<kind>=N changes a count. GPU processes keep torch's default for their host work. No Ray,
no torch at import.
"""
from __future__ import annotations

import os
import time

KINDS = ("driver", "regenerate", "target", "trainer", "evaluate")


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def threads_for(cpu_threads, kind: str) -> int:
    """The thread count of a process kind from cluster.cpu_threads (a config node, a dataclass or a dict; None:
    the defaults); null means every usable core (the driver adapts within that: FreeCoreThreads)."""
    if kind not in KINDS:
        raise ValueError(f"unknown process kind {kind!r} (one of {', '.join(KINDS)})")
    if cpu_threads is None:
        from dflash_ray.config import CpuThreadsConfig

        cpu_threads = CpuThreadsConfig()
    value = cpu_threads.get(kind) if isinstance(cpu_threads, dict) else getattr(cpu_threads, kind)
    return usable_cores() if value is None else max(1, int(value))


def use_threads(cpu_threads, kind: str) -> int:
    """Set this process's torch intra-op threads for its kind; returns the count."""
    import torch

    n = threads_for(cpu_threads, kind)
    torch.set_num_threads(n)
    return n


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot (/proc/stat's cpu line)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]   # user nice system idle iowait irq softirq steal
    return v[0] + v[1] + v[2] + v[5] + v[6] + v[7], sum(v)


def _own_ticks() -> int:
    """This process's user + system clock ticks, all its threads."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


class FreeCoreThreads:
    """The driver's threads during a long compute phase: as many as the cores other processes left free over
    the last `every_s` seconds (at most `cap`, at least 1), set on torch when called (each step; it looks at
    the machine every `every_s`). Other processes' use is the machine's busy time less this process's, so its
    own threads never count against it. Off Linux (no /proc): `cap` threads, never changed."""

    def __init__(self, cap: int, every_s: float = 5.0, first_sample_s: float = 0.25):
        import torch

        self.torch, self.cap, self.every_s = torch, max(1, int(cap)), every_s
        self.counts: list[int] = []   # the thread counts chosen, in order (the phase's report)
        try:
            self._mark()
        except OSError:
            self._last = None
            self._set(self.cap)
            return
        time.sleep(first_sample_s)   # the first choice needs a window to look at
        self._choose()

    def _mark(self) -> None:
        self._last = (time.monotonic(), *_machine_ticks(), _own_ticks())

    def _choose(self) -> None:
        t0, busy0, total0, own0 = self._last
        self._mark()
        _, busy1, total1, own1 = self._last
        if total1 <= total0:
            return
        others = max(0, (busy1 - busy0) - (own1 - own0)) / (total1 - total0) * usable_cores()
        self._set(max(1, min(self.cap, int(usable_cores() - others + 0.3))))

    def _set(self, n: int) -> None:
        if not self.counts or self.counts[-1] != n:
            self.torch.set_num_threads(n)
            self.counts.append(n)

    def __call__(self, *_) -> None:
        if self._last is not None and time.monotonic() - self._last[0] >= self.every_s:
            self._choose()
