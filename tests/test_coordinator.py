"""The run coordinator's flight window (runtime/coordinator.py): rows admitted in order, blocked beyond the
window, released by a new stream; and rank 0's commits against the window's slack (runtime/training/record_client.py)."""
from __future__ import annotations


def test_flight_window_admits_in_order_and_blocks_beyond(ray_session, tmp_path):
    import ray

    from dflash_ray.runtime.coordinator import RunCoordinator

    coord = ray.remote(RunCoordinator).options(num_cpus=0, max_concurrency=100).remote("window", 3)
    gen = 1                                                 # numbered by the run record (RunRecord.new_stream)
    ray.get(coord.reset_feed.remote(gen, 10, {}, 2))
    assert ray.get([coord.admit.remote(gen, i) for i in range(3)]) == [True] * 3
    blocked = coord.admit.remote(gen, 3)
    ready, _ = ray.wait([blocked], timeout=1.0)
    assert not ready                                        # row 3 waits: 3 rows in flight
    coord.consumed_upto.remote(gen, 1)
    assert ray.get(blocked, timeout=30) is True             # row 0 trained -> row 3 admitted
    stale = coord.admit.remote(gen, 9)
    ray.get(coord.reset_feed.remote(gen + 1, 10, {}, 2))    # a restarted stream releases old waiters
    assert ray.get(stale, timeout=30) is False
    assert ray.get(coord.feed_info.remote())["gen"] == gen + 1
    report = ray.get(coord.report.remote())
    assert report["max_batches_in_flight"] == 3
    ray.kill(coord)


def test_flight_window_holds_a_step_two_rounds_and_the_report_slack(ray_session, tmp_path):
    """Blocks of 4 rows on 2 ranks, 2 rows a step: a block is admitted by its last row, so the window
    holds the step and two rounds (2 + 2 x 4 x 2 = 18 rows), plus one block's rows (4) that rank 0 may
    have trained without reporting them yet: 22, not the configured 3. One row a block: as configured,
    reported every step."""
    import ray

    from dflash_ray.runtime.coordinator import RunCoordinator

    coord = ray.remote(RunCoordinator).options(num_cpus=0, max_concurrency=100).remote("blocks", 3)
    gen = 1
    ray.get(coord.reset_feed.remote(gen, 10, {}, 2, rows_per_block=4, world=2))
    assert ray.get(coord.feed_info.remote())["report_slack_rows"] == 4
    assert ray.get(coord.admit.remote(gen, 21), timeout=30) is True
    blocked = coord.admit.remote(gen, 22)
    ready, _ = ray.wait([blocked], timeout=1.0)
    assert not ready
    ray.get(coord.consumed_upto.remote(gen + 1, 4))                      # another stream's rows move nothing
    ready, _ = ray.wait([blocked], timeout=1.0)
    assert not ready
    ray.get(coord.consumed_upto.remote(gen, 1))                          # row 0 trained: 22 < 1 + 22
    assert ray.get(blocked, timeout=30) is True
    assert ray.get(coord.report.remote())["window"] == 22
    ray.get(coord.reset_feed.remote(gen + 1, 10, {}, 2, rows_per_block=1, world=2))   # one row a block
    assert ray.get(coord.report.remote())["window"] == 3
    assert ray.get(coord.feed_info.remote())["report_slack_rows"] == 0
    ray.kill(coord)


def test_rank0_reports_at_start_on_time_and_before_the_window_runs_short():
    from dflash_ray.runtime.training.record_client import COMMIT_INTERVAL_S, commit_due

    assert commit_due(0, 0.0, 2, 64)                        # the first step at once
    assert not commit_due(5, 0.01, 12, 64)                  # tiny steps: wait and send several
    assert commit_due(5, COMMIT_INTERVAL_S, 12, 64)         # but at least every COMMIT_INTERVAL_S
    assert not commit_due(40, 0.01, 64, 64) and commit_due(40, 0.01, 66, 64)   # never more than the slack late
    assert commit_due(7, 0.0, 2, 0)                         # no slack (one row a block): every step
