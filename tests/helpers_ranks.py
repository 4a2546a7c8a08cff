"""Real torch.distributed ranks for the tests: each rank a fresh interpreter (not mp.spawn from the test
process, which may hold a Ray session's state), joined over gloo through a file store in the test's own
directory (no port to race for with the Ray processes the session started).

A rank that is stuck prints its stack and exits (faulthandler) before the test's own wait runs out, and a wait
that does run out kills every rank: a hung collective fails its test instead of holding the suite (and CI's
pipe) for gloo's 30-minute time-out."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def init_ranks(rank: int, world: int, store: str, name: str = "store") -> None:
    """The rank's gloo process group, through the file `store`/`name` (a fresh name for each group a set of
    processes makes in turn)."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{Path(store) / name}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))


def run_ranks(module: str, fn: str, world: int, store: Path, *args, timeout: float = 300) -> None:
    """`module.fn(rank, world, store, *args)` in `world` fresh interpreters; the arguments go by repr (str,
    numbers, lists). Fails the test with the ranks' output if any rank exits non-zero or the wait runs out."""
    store = Path(store)
    store.mkdir(parents=True, exist_ok=True)
    call = ", ".join(repr(a) for a in (world, str(store), *args))
    procs = [subprocess.Popen(
        [sys.executable, "-c",
         f"import faulthandler, sys; faulthandler.dump_traceback_later({int(timeout) - 30}, exit=True); "
         f"sys.path[:0] = {sys.path!r}; from {module} import {fn}; {fn}({rank}, {call}); "
         "import os; os._exit(0)"],   # its results are written: the interpreter's teardown of gloo is not under test
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(world)]
    deadline, outs = time.monotonic() + timeout, []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * world, "\n".join(outs)[-4000:]
