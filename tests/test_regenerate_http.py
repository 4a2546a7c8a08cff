"""`regenerate.engine=http` against a real OpenAI-compatible server: `transformers serve` on 127.0.0.1 over the
demo's shipped target (its end-of-turn token declared in the served copy's generation_config, as a served
model declares it). Every regenerated turn equals the batched engine's on the same weights; the server gone
mid-run stops the job with one line naming the URL, keeps what was written, and a rerun resumes to every
conversation once; a 500 on some requests is retried, and a request still failing is counted, its
conversation cut, the job going on. The faults come from a forwarding proxy (a real HTTP server in front of the
real one) that refuses what the test asks it to."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers_cluster import free_ports

from dflash_ray.cli import main
from dflash_ray.demo.world import SHIPPED

pytestmark = [pytest.mark.slow, pytest.mark.rounding]
SERVE = str(Path(sys.executable).parent / "transformers")
TURN_CAP = ["regenerate.max_new_tokens=60", "regenerate.on_max_tokens=keep", "regenerate.batch_size=2"]


def _served_copy(root: Path) -> Path:
    """The shipped target and its tokenizer in one directory, its end-of-turn token declared."""
    model = root / "model"
    shutil.copytree(SHIPPED / "target", model)
    for f in (SHIPPED / "tokenizer").iterdir():
        shutil.copy(f, model / f.name)
    config = json.loads((model / "generation_config.json").read_text())
    eos = json.loads((model / "tokenizer.json").read_text())
    eos_id = next(t["id"] for t in eos["added_tokens"] if t["content"] == "<|im_end|>")
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [eos_id]}))
    return model


def _get(url, timeout=5.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except OSError:
        return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model = _served_copy(root)
    [port] = free_ports(1)
    log = open(root / "serve.log", "w")
    proc = subprocess.Popen([SERVE, "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 180
    while _get(f"http://127.0.0.1:{port}/v1/models") is None:
        assert proc.poll() is None and time.time() < deadline, (root / "serve.log").read_text()[-3000:]
        time.sleep(1)
    yield {"url": f"http://127.0.0.1:{port}/v1", "model": model}
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


class Proxy:
    """A forwarding HTTP server in front of the real one: `refuse(body) -> status | None` answers a request
    itself (a 500) instead of forwarding it; `close()` stops listening (the server gone)."""

    def __init__(self, upstream: str, refuse=lambda path, body: None, port: int | None = None):
        proxy = self
        self.seen = 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _forward(self, method):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else None
                proxy.seen += self.path.endswith("/completions")
                status = refuse(self.path, body)
                if status:
                    self.send_response(status)
                    self.end_headers()
                    return
                req = urllib.request.Request(upstream + self.path.removeprefix("/v1"), data=body, method=method,
                                             headers={"content-type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=120) as r:
                        data, code = r.read(), r.status
                except urllib.error.HTTPError as e:
                    data, code = e.read(), e.code
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port or 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _conversations(path: Path, n: int) -> list[dict]:
    from dflash_ray.config import compose_config
    from dflash_ray.demo.world import write_generated

    cfg = compose_config([])
    write_generated(cfg, path, n, split="train")
    return [json.loads(line) for line in path.read_text().splitlines()]


def _args(tmp_path, server, out: Path) -> list[str]:
    return ["regenerate", "--json", f"data.input={tmp_path / 'in.jsonl'}", f"data.tokenizer={server['model']}",
            f"model.target_path={server['model']}", f"regenerate.output={out}", "model.compute_dtype=float32",
            *TURN_CAP]


def _run(tmp_path, server, out: Path, *extra, capsys=None):
    rc = main([*_args(tmp_path, server, out), *extra])
    captured = capsys.readouterr() if capsys else None
    return rc, (json.loads(captured.out) if captured and rc == 0 else captured)


def _by_id(path: Path) -> dict:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_every_turn_equals_the_batched_engines_on_the_same_weights(server, ray_session, tmp_path, capsys):
    rows = _conversations(tmp_path / "in.jsonl", 12)
    rc, http = _run(tmp_path, server, tmp_path / "http.jsonl", "regenerate.engine=http", f"regenerate.url={server['url']}",
                    capsys=capsys)
    assert rc == 0, http
    rc, batched = _run(tmp_path, server, tmp_path / "batched.jsonl", capsys=capsys)
    assert rc == 0, batched
    a, b = _by_id(tmp_path / "http.jsonl"), _by_id(tmp_path / "batched.jsonl")
    assert sorted(a) == sorted(b) == sorted(r["id"] for r in rows)
    turns = [(rid, k) for rid in b for k, m in enumerate(b[rid]["conversations"]) if m["role"] == "assistant"]
    differ = [(rid, k) for rid, k in turns if a[rid]["conversations"][k] != b[rid]["conversations"][k]]
    assert turns and differ == [], differ
    for key in ("regenerated turns", "hit max_new_tokens"):
        assert http.get(key) == batched.get(key), key


def test_the_server_gone_mid_run_stops_in_one_line_and_a_rerun_resumes(server, ray_session, tmp_path, capsys):
    rows = _conversations(tmp_path / "in.jsonl", 10)
    proxy = Proxy(server["url"])
    port = proxy.httpd.server_address[1]
    def stop_after_some():
        while proxy.seen < 6:        # a few turns answered, then the server is gone
            time.sleep(0.05)
        proxy.close()

    gone = threading.Thread(target=stop_after_some, daemon=True)
    gone.start()
    out = tmp_path / "out.jsonl"
    # as a user runs it (its own process and Ray, the console as the CLI sets it up): what it prints is its own
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    env["HOME"] = str(tmp_path / "home")
    r = subprocess.run([sys.executable, "-m", "dflash_ray", *_args(tmp_path, server, out), "regenerate.engine=http",
                        f"regenerate.url={proxy.url}", "regenerate.max_retries=1", "regenerate.concurrency=1",
                        f"run.root={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 2, r.stderr[-3000:]
    ours = ("regenerate:", "started a local Ray", "Ray's own logs")
    err = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith(ours)]
    assert len(err) == 1 and proxy.url in err[0] and "rerun to resume" in err[0], r.stderr[-3000:]
    before = out.read_text().splitlines() if out.exists() else []
    assert len(before) < len(rows)
    again = Proxy(server["url"], port=port)       # the server back, at the same address
    try:
        rc, counts = _run(tmp_path, server, out, "regenerate.engine=http", f"regenerate.url={again.url}",
                          capsys=capsys)
    finally:
        again.close()
    assert rc == 0
    assert counts["skipped: already in the output"] == len(before)
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == sorted(r["id"] for r in rows)          # every conversation once


def test_a_500_is_retried_and_a_request_still_failing_is_counted(server, ray_session, tmp_path, capsys):
    rows = _conversations(tmp_path / "in.jsonl", 8)
    victims = {next(m["content"] for m in rows[1]["conversations"] if m["role"] == "user")}   # every turn of it
    first_tries = set()

    def refuse(path, body):
        if not body:
            return None
        prompt = json.loads(body)["prompt"]
        if any(v in prompt for v in victims):
            return 500                                   # always: counted after the retries
        if prompt not in first_tries:
            first_tries.add(prompt)
            return 503                                   # once: the retry goes through
        return None

    proxy = Proxy(server["url"], refuse)
    try:
        rc, counts = _run(tmp_path, server, tmp_path / "out.jsonl", "regenerate.engine=http",
                          f"regenerate.url={proxy.url}", "regenerate.max_retries=2", capsys=capsys)
    finally:
        proxy.close()
    assert rc == 0, counts
    assert counts["turns dropped: the server failed it (HTTP 500) after 2 retries"] >= 1
    out = _by_id(tmp_path / "out.jsonl")
    assert rows[1]["id"] not in out or len(out[rows[1]["id"]]["conversations"]) < len(rows[1]["conversations"])
    assert len(out) >= len(rows) - 1                         # the others regenerated, each after a 503 once
