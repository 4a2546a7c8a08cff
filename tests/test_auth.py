"""Token authentication as users meet it (Ray 2.60 turns it on by default): a head started by
scripts/ray-start.sh with RAY_AUTH_MODE unset runs with token auth, on a token Ray's own CLI made; a job
submitted by a jobs/ script from the machine that holds the token is taken (the script sends it), and one
that sends no token is refused. HOME is the test's own: the token is never the user's."""
import os
import subprocess
import time
import urllib.request

import pytest
from helpers_cluster import REPO, FreshHead

pytestmark = pytest.mark.slow


def test_a_head_started_by_the_script_takes_the_scripts_jobs_with_its_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env["HOME"] = str(tmp_path / "home")
    head = FreshHead(tmp_path / "head.log", env, start=("bash", str(REPO / "scripts" / "ray-start.sh")))
    try:
        token = tmp_path / "home" / ".ray" / "auth_token"
        deadline = time.time() + 120
        while not token.is_file() or answer(head.address, token.read_text().strip()) is None:
            assert not head.died() and time.time() < deadline, head.log_tail()
            time.sleep(1)
        assert len(token.read_text().strip()) >= 32                          # made for the head, by Ray's CLI
        assert answer(head.address, "not-the-token") is None                 # the dashboard asks for it
        job_env = {**env, "RAY_ADDRESS": head.address}
        for _ in range(20):     # the dashboard answers before its job agent is up: Ray says to retry
            taken = subprocess.run(["bash", "jobs/local.sh", "--cfg", "job"], cwd=REPO, env=job_env,
                                   capture_output=True, text=True, timeout=300)
            if "No available agent" not in taken.stdout + taken.stderr:
                break
            time.sleep(2)
        assert taken.returncode == 0, taken.stdout[-2000:] + taken.stderr[-2000:]
        assert "succeeded" in taken.stdout.lower() and "cluster:" in taken.stdout      # the job printed its config
        refused = subprocess.run(["bash", "jobs/local.sh", "--cfg", "job"], cwd=REPO, timeout=300,
                                 env={**job_env, "RAY_AUTH_MODE": "disabled"}, capture_output=True, text=True)
        assert refused.returncode != 0 and "auth" in (refused.stdout + refused.stderr).lower()
    finally:
        head.stop()


def answer(address: str, token: str):
    """The dashboard's version, asked with the token as Ray's clients send it; None if it does not answer."""
    request = urllib.request.Request(f"{address}/api/version", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            return r.read().decode()
    except OSError:
        return None
