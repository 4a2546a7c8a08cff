"""The console of a command that runs Ray: the command's own lines and every real error, not Ray's routine
messages on a healthy run. Ray writes these into its own log files anyway (`<session>/logs`: raylet.out,
python-core-driver-*.log, ray-data.log); the command says where at its end. `--debug` shows everything.

What is kept off the console, and how:
- the token-auth warning of a local Ray: RAY_AUTH_MODE set explicitly (runtime/cluster.py; token auth stays on);
- Ray's INFO lines ("Started a local Ray instance"): ray.init(logging_level=WARNING) (runtime/cluster.py);
- Ray Data's INFO lines and progress bars (the commands print their own progress): RAY_DATA_LOGGING_CONFIG,
  Ray Data's own switch for its loggers, set to RAY_DATA_LOGGING (ray-data.log keeps everything, the console
  only errors), and RAY_DATA_DISABLE_PROGRESS_BARS, both before Ray Data is imported;
- two messages written past Python's logging, which only a filter on the process's stdout and stderr can hold
  back, matched exactly (NOISE): the raylet's "N PYTHON worker processes have been started ... the maximum
  expected startup concurrency" (a local Ray on a machine with few cores: Ray caps its start-up concurrency
  at the core count, and a run's actors outnumber it), and the driver's core_worker line about "constructor
  arguments in the object store and max_restarts > 0", which Ray prints for every Ray Data actor pool (its
  restarts are what replace a dead target actor). Every other line passes through at once.
No Ray and no torch here.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from pathlib import Path

DEBUG = "DFLASH_RAY_DEBUG"   # set by --debug: Ray's own messages on the console too (runtime/cluster.py reads it)


def debug_console() -> bool:
    return os.environ.get(DEBUG) == "1"


# Ray Data's loggers: everything into ray-data.log in the session's logs (Ray Data's own handler), errors only
# on the console.
RAY_DATA_LOGGING = Path(__file__).resolve().parent / "ray_data_logging.yaml"

NOISE = (
    re.compile(rb"^(\x1b\[\d+m)?\(raylet\)(\x1b\[0m)? WARNING: \d+ PYTHON worker processes have been started on node"),
    re.compile(rb"^\[[^\]]* E \d+ \d+\] core_worker\.cc:\d+: Actor with class name: .* has constructor arguments in "
               rb"the object store and max_restarts > 0"),
)
# what a noise line starts with: a partial line that could become one is held back until its end
NOISE_STARTS = (b"(raylet)", b"\x1b[33m(raylet)", b"[")


def is_noise(line: bytes) -> bool:
    return any(p.search(line) for p in NOISE)


def quiet_ray_environment() -> None:
    """Ray Data's console to errors and no progress bars of its own, for this process and the Ray workers it
    starts (their environment is inherited). Before Ray Data is imported; a value the user set wins."""
    os.environ.setdefault("RAY_DATA_LOGGING_CONFIG", str(RAY_DATA_LOGGING))
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")


class _Pump(threading.Thread):
    """Copies what is written to one of the process's file descriptors (now a pipe) to where it went before,
    leaving out NOISE lines; a partial line is written at once unless it could be the start of one."""

    def __init__(self, read_fd: int, out_fd: int):
        super().__init__(daemon=True, name=f"console-{out_fd}")
        self.read_fd, self.out_fd, self.held = read_fd, out_fd, 0

    def _write(self, data: bytes) -> None:
        while data:
            data = data[os.write(self.out_fd, data):]

    def run(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self.read_fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                if pending and not is_noise(pending):
                    self._write(pending)
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if is_noise(line):
                    self.held += 1
                else:
                    self._write(line + b"\n")
            if pending and not pending.startswith(NOISE_STARTS) and not any(
                    s.startswith(pending) for s in NOISE_STARTS):
                self._write(pending)        # a progress bar's \r-line, a prompt: at once
                pending = b""


@contextlib.contextmanager
def quiet_console(enabled: bool = True):
    """Within: the process's stdout and stderr (fds 1 and 2, so C++ and child processes' writes too) go
    through a filter that leaves out NOISE. Yields the pumps (`held`: lines left out)."""
    if not enabled:
        yield []
        return
    pumps, saved = [], []
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        stream.flush()
        read_fd, write_fd = os.pipe()
        saved.append((fd, os.dup(fd)))
        os.dup2(write_fd, fd)
        os.close(write_fd)
        pump = _Pump(read_fd, saved[-1][1])
        pump.start()
        pumps.append(pump)
    try:
        yield pumps
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, copy in saved:
            os.dup2(copy, fd)          # our end of the pipe closes; a child still holding it keeps its pump alive
        for pump in pumps:
            pump.join(timeout=2.0)
