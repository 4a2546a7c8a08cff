"""benchmarks/peers/: the parts that run without the peers' venv (the peers themselves are measured by
benchmarks/peers/step_loop.py, not by the tests: their venv is outside the project's dependencies)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"


def _load(name):
    sys.path.insert(0, str(PEERS))
    try:
        spec = importlib.util.spec_from_file_location(name, PEERS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(PEERS))


def test_the_profile_puts_a_log_softmax_in_the_cross_entropy_and_sdpa_in_attention():
    harness = _load("harness")
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    w = torch.randn(8, 64, requires_grad=True)

    def step():
        h = F.scaled_dot_product_attention(q, q, q)
        F.cross_entropy((h.reshape(-1, 8) @ w), torch.zeros(32, dtype=torch.long)).backward()

    out = harness.profile_steps(step, 2)
    parts = out["by_part"]
    assert parts["cross-entropy over the vocabulary"] > 0 and parts["attention"] > 0
    assert parts["matmuls (linear layers and the LM head)"] > 0
    assert abs(sum(parts.values()) - out["seconds_per_step"]) < 1e-9
    # the op names it was told apart by: a log-softmax is never attention, whatever "softmax" says
    part_of = lambda name: next((p for p, frags in harness.PARTS if any(f in name.lower() for f in frags)), "other")  # noqa: E731
    assert part_of("aten::_log_softmax_backward_data") == "cross-entropy over the vocabulary"
    assert part_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"


def test_without_the_peers_venv_the_command_says_what_to_run_and_exits_2(tmp_path, capsys):
    step_loop = _load("step_loop")
    step_loop.PEERS_PY = tmp_path / "no-venv" / "bin" / "python"
    assert step_loop.main(["--work", str(tmp_path / "w.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "benchmarks/peers/setup.sh" in err[0]
    assert not (tmp_path / "w.pt").exists()
