"""CPU threads: how many torch uses in each kind of process, and how idle threads wait. One place, chosen
by measurement (benchmarks/bench_threads.py on the two-core machine, quiet | beside one busy process; ms per
unit of each kind's real work, lower is better):

    kind        1 thread     2 threads spinning   2 threads sleeping
    driver      459 |  557       262 | 2222          430 |  634    the demo target's training step
    regenerate  429 |  455       427 | 1785          885 |  553    generate(): 32 rows x 64 new tokens
    target       19 |   16        12 |   32           31 |   20    a target actor's feature forward
    trainer     278 |  365       147 |  568          276 |  371    a drafter training step
    evaluate    651 |  694       721 | 2521         1145 |  731    speculative + greedy decoding, one prompt

Spinning (OpenMP's default: idle threads spin, OMP_WAIT_POLICY=ACTIVE) makes a second thread pay off on a
quiet machine and cost 4x beside a busy process, whose time slices the spinning thread burns while its
partner waits for a core. So:

    driver      the job's own compute (the demo target's training): every usable core, waiting asleep
                (OMP_WAIT_POLICY=PASSIVE, set by the command before torch loads: `sleeping_waits`; a value
                the user set wins): 430 | 634, better than one thread in both, and a fixed count, so the
                target trains to the same weights whatever else the machine runs (its float sums depend
                on the thread count; a count chosen by the load, tried, gave another target under load)
    regenerate, target, trainer, evaluate
                1 each: they run beside each other (two trainers and a target actor on two cores; a
                regeneration actor per core), or are no faster with two (decoding's small matmuls)

cluster.cpu_threads.<kind>=N changes a count. GPU processes keep torch's default for their host work. No Ray,
no torch at import.
"""
from __future__ import annotations

import os

KINDS = ("driver", "regenerate", "target", "trainer", "evaluate")


def sleeping_waits() -> None:
    """Idle OpenMP threads sleep instead of spinning, in this process and the processes it starts (a local
    Ray's): call before torch is imported; OMP_WAIT_POLICY already set wins."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def threads_for(cpu_threads, kind: str) -> int:
    """The thread count of a process kind from cluster.cpu_threads (a config node, a dataclass or a dict; None:
    the defaults); null means every usable core."""
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
