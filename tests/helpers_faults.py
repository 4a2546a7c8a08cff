"""What the fault tests on a real Ray share (tests/reliability/test_faults_*.py): the runs' base overrides,
and readers of a run's checkpoints, ledger and events. W = 2 (two drafter workers), 10 plan batches per epoch
of the tiny data: 5 steps an epoch."""
from __future__ import annotations

from pathlib import Path

from dflash_ray.run_layout import LEDGER
from dflash_ray.runtime.record.ledger import read_jsonl
from dflash_ray.runtime.training.checkpoint_format import read_state

# the fault runs' base: two epochs, a checkpoint every 2 steps, all of them kept (the tests read each)
BASE = ["train.epochs=2", "train.checkpoint_every=2", "train.num_to_keep=10"]


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(Path(run_dir) / "events.jsonl") if e["event"] == kind]


def checkpoints_by_step(experiment_dir: str) -> dict[int, Path]:
    """Every complete checkpoint in storage, by its cursor's step."""
    out = {}
    for d in sorted(Path(experiment_dir).glob("checkpoint_*")):
        try:
            out[read_state(d)["cursor"]["step"]] = d
        except Exception:  # noqa: BLE001 - an incomplete one is not listed
            pass
    return out


def expected_positions(plan_batches: list[int], steps: int) -> list[list[int]]:
    """The plan positions of steps 1..steps at W = 2 (an epoch's odd last batch is padded with a filler)."""
    out = []
    for n in plan_batches:
        out += [[p if p < n else -1 for p in (2 * s, 2 * s + 1)] for s in range(-(-n // 2))]
    return out[:steps]


def assert_exact(run_dir: Path, plan_batches, steps: int) -> list[dict]:
    ledger = read_jsonl(Path(run_dir) / LEDGER)
    assert [r["step"] for r in ledger] == list(range(1, steps + 1))
    assert [r["positions"] for r in ledger] == expected_positions(plan_batches, steps)
    return ledger


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    return text
