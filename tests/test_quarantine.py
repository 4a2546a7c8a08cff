"""Poison batches set aside (runtime/record/quarantine.py, stream/feed.py): which batches a failed worker group
names, "in a row", what the next feed does with them, and that a rerun keeps them. No Ray: the run that
quarantines a real crash is in reliability/test_faults_poison.py."""
from __future__ import annotations

import numpy as np

from dflash_ray.data.plan import PlanSpec, build_plan
from dflash_ray.runtime.record.quarantine import NO_LINE, Quarantine
from dflash_ray.runtime.stream.feed import Cursor, build_feed
from dflash_ray.runtime.stream.rows import QUARANTINED


def test_a_batch_that_fails_twice_in_a_row_is_set_aside(tmp_path):
    q = Quarantine(tmp_path / "quarantine.json")
    # gen 1: ranks 0 and 1 in step 3 (batches (0, 4) and (0, 5)); rank 1's step raises first, then rank 0's
    # collective error would be dropped by the worker (record_client.peer_gone), so only rank 1's counts
    q.in_flight(1, 0, 3, [(0, 4)])
    q.in_flight(1, 1, 3, [(0, 5)])
    q.failed(1, 1, 3, [(0, 5)], "IndexError: index 9 is out of bounds")
    assert q.end(1, limit=2) == []                     # once: not yet
    q.in_flight(2, 0, 3, [(0, 4)])
    q.in_flight(2, 1, 3, [(0, 5)])
    q.failed(2, 1, 3, [(0, 5)], "IndexError: index 9 is out of bounds")
    new = q.end(2, limit=2)
    assert [(e["epoch"], e["position"], e["step"], e["reason"]) for e in new] == [
        (0, 5, 3, "IndexError: index 9 is out of bounds")]
    assert q.batches() == [(0, 5)]
    # a rerun's record reads the file: still set aside
    assert Quarantine(tmp_path / "quarantine.json").batches() == [(0, 5)]


def test_a_process_killed_outright_names_every_batch_of_its_step(tmp_path):
    q = Quarantine(tmp_path / "q.json")
    for gen in (1, 2):
        q.in_flight(gen, 0, 6, [(1, 0)])
        q.in_flight(gen, 0, 7, [(1, 2)])                # rank 0 moved on to step 7
        q.in_flight(gen, 1, 7, [(1, 3)])
        new = q.end(gen, limit=2)
    assert [(e["position"], e["reason"]) for e in new] == [(2, NO_LINE), (3, NO_LINE)]


def test_not_in_a_row_or_outside_a_step_or_off_quarantines_nothing(tmp_path):
    q = Quarantine(tmp_path / "q.json")
    fail = lambda gen, pos: (q.in_flight(gen, 0, 2, [(0, pos)]), q.end(gen, limit=2))[1]  # noqa: E731
    assert fail(1, 2) == [] and fail(2, 3) == []        # two failures, other batches
    q.in_flight(3, 0, 2, [(0, 3)])
    q.in_flight(3, 0, 2, [])                            # the step done (a checkpoint): nothing in flight
    assert q.end(3, limit=2) == []
    assert fail(4, 3) == []                             # not in a row with gen 2: gen 3 broke the chain
    off = Quarantine(tmp_path / "off.json")
    for gen in (1, 2, 3):
        off.in_flight(gen, 0, 2, [(0, 3)])
        assert off.end(gen, limit=0) == []              # train.quarantine_after=0
    assert q.end(0, limit=2) == []                      # no stream yet (the first feed of a run)
    assert not (tmp_path / "off.json").exists()


def test_the_feed_keeps_a_quarantined_batch_in_its_step_with_nothing_to_compute():
    lengths = np.random.default_rng(0).integers(40, 500, size=200)
    plan = build_plan(np.arange(200), lengths, PlanSpec(boundaries=[96, 192, 512], max_tokens_per_batch=1024,
                                                        min_tokens=16), seed=0, epoch=0)
    plain = build_feed(lambda e: plan, Cursor(), 2, epochs=1, max_steps=None).table.to_pydict()
    aside = build_feed(lambda e: plan, Cursor(), 2, epochs=1, max_steps=None, quarantined=[(0, 5)]).table.to_pydict()
    assert aside["position"] == plain["position"] and aside["epoch"] == plain["epoch"]   # the same steps
    k = plain["position"].index(5)
    assert aside["bucket"][k] == QUARANTINED and aside["num_tokens"][k] == 0
    assert aside["sample_ids"][k] == [] and aside["lengths"][k] == []
    assert plain["sample_ids"][k] == plan.batch(5).tolist()
    for col in ("bucket", "num_tokens", "sample_ids", "lengths"):   # every other row as it was
        assert [v for i, v in enumerate(aside[col]) if i != k] == [v for i, v in enumerate(plain[col]) if i != k]
