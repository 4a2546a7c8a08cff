"""A command's console shows its own lines and real errors, not Ray's routine messages (dflash_ray/console.py):
the filter on the process's stdout and stderr leaves out exactly the two known lines Ray writes past Python's
logging, whoever writes them (Python, a C++ library, a child process), passes everything else at once, and
is off with --debug; and a real `dflash-ray regenerate`, which starts a local Ray and a Ray Data actor pool,
prints no line of Ray's on a healthy run (no token-auth warning, no INFO, no core_worker or raylet line)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# the two lines as Ray 2.60 writes them (copied from a default job's console)
RAYLET = ("\x1b[33m(raylet)\x1b[0m WARNING: 8 PYTHON worker processes have been started on node: b81cf5 with address: "
          "192.0.2.2, which is 4x the maximum expected startup concurrency (2). This could be a result of ...")
CORE_WORKER = ("[2026-12-07 02:59:58,769 E 26490 26490] core_worker.cc:2465: Actor with class name: "
               "'MapWorker(MapBatches(RegenerateActor))' and ID: '9114b8' has constructor arguments in the object "
               "store and max_restarts > 0. If the arguments in the object store go out of scope or are lost, ...")
REAL = "[2026-12-07 03:00:00,000 E 1 1] core_worker.cc:100: Failed to connect to the GCS"

SCRIPT = f"""
import os, subprocess, sys
from dflash_ray.console import quiet_console
with quiet_console(enabled={{enabled}}) as pumps:
    print("ours: step 1/2")
    print({RAYLET!r})
    sys.stdout.flush()
    os.write(2, ({CORE_WORKER!r} + "\\n").encode())          # as C++ writes: straight to fd 2
    os.write(2, ({REAL!r} + "\\n").encode())
    subprocess.run(["printf", "%s\\\\n", {RAYLET!r}])           # a child's own stdout
    os.write(2, b"progress 50%\\r")                              # a partial line is not held back
    print("ours: done", flush=True)
held = sum(p.held for p in pumps)
print("held", held)
"""


def _run(enabled: bool):
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(enabled=enabled)], capture_output=True, timeout=60)
    return r.returncode, r.stdout.decode(), r.stderr.decode()   # bytes: a \r stays a \r


def test_the_filter_leaves_out_exactly_rays_two_routine_lines():
    rc, out, err = _run(True)
    assert rc == 0, err
    assert out.splitlines() == ["ours: step 1/2", "ours: done", "held 3"]
    assert err == REAL + "\n" + "progress 50%\r"


def test_debug_shows_everything():
    rc, out, err = _run(False)
    assert rc == 0, err
    assert out.splitlines() == ["ours: step 1/2", RAYLET, RAYLET, "ours: done", "held 0"]
    assert err == CORE_WORKER + "\n" + REAL + "\n" + "progress 50%\r"


@pytest.mark.slow
def test_a_healthy_regeneration_prints_no_line_of_rays(tmp_path):
    from helpers_data import make_tokenizer, write_jsonl
    from helpers_model import TINY_QWEN3

    from dflash_ray.model.target import build_synthetic_target
    from dflash_ray.tokenizer import load_tokenizer

    _, tokdir = make_tokenizer(tmp_path)
    target = build_synthetic_target({**TINY_QWEN3, "num_hidden_layers": 2}, len(load_tokenizer(str(tokdir))),
                                    str(tmp_path / "target"), seed=1)
    rows = [{"id": f"r{i}", "conversations": [{"role": "user", "content": f"Repeat red blue {i} times."},
                                              {"role": "assistant", "content": "red blue"}]} for i in range(6)]
    write_jsonl(tmp_path / "in.jsonl", rows)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    env["HOME"] = str(tmp_path / "home")       # Ray writes the token it makes into ~/.ray: this test's, not the user's
    r = subprocess.run([sys.executable, "-m", "dflash_ray", "regenerate", "--json", f"data.input={tmp_path / 'in.jsonl'}",
                        f"data.tokenizer={tokdir}", f"model.target_path={target}", f"regenerate.output={tmp_path / 'out.jsonl'}",
                        "regenerate.max_new_tokens=4", "regenerate.on_max_tokens=keep", f"run.root={tmp_path / 'runs'}"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["written"] == 6
    ours = ("regenerate:", "regenerated ", "started a local Ray")
    rays = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith(ours)]
    assert rays == [], rays
    assert (tmp_path / "home" / ".ray" / "auth_token").is_file()   # token auth stayed on, chosen without Ray's warning
