"""Interleaving strategies and their measures (the heart of the batch order)."""
import numpy as np
import pytest

from dflash_ray.data.interleave import STRATEGIES, interleave_order, order_measures

SEED_RUN = [2120, 4019, 5468, 7477, 8038, 19581]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_is_a_deterministic_permutation_of_the_counts(strategy):
    a = interleave_order(SEED_RUN, strategy=strategy, seed=3, epoch=1)
    b = interleave_order(SEED_RUN, strategy=strategy, seed=3, epoch=1)
    assert a.dtype.kind == "i" and a.size == sum(SEED_RUN)
    assert np.array_equal(a, b)
    assert np.bincount(a, minlength=6).tolist() == SEED_RUN


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "sequential"])
def test_seeds_and_epochs_change_the_order(strategy):
    base = interleave_order(SEED_RUN, strategy=strategy, seed=0, epoch=0)
    assert not np.array_equal(base, interleave_order(SEED_RUN, strategy=strategy, seed=1, epoch=0))
    assert not np.array_equal(base, interleave_order(SEED_RUN, strategy=strategy, seed=0, epoch=1))


def test_default_meets_the_seed_run_targets():
    m = order_measures(interleave_order(SEED_RUN, seed=0), 6)
    assert m["quarter_max_dev_pp"] <= 0.1
    assert m["longest_run"] == 1  # no bucket holds more than half the batches
    assert m["prefix_discrepancy"] <= 2
    assert min(m["last_batch_fraction"]) >= 0.999


def test_stride_reproduces_the_seed_run_and_default_beats_it_on_every_measure():
    n = sum(SEED_RUN)
    one_batch_pp = 100 * 4 / n  # one batch more or less in a quarter
    for seed in range(10):
        s = order_measures(interleave_order(SEED_RUN, strategy="stride", seed=seed), 6)
        d = order_measures(interleave_order(SEED_RUN, strategy="default", seed=seed), 6)
        assert s["quarter_max_dev_pp"] < 0.1 and 2 <= s["longest_run"] <= 5
        assert d["longest_run"] < s["longest_run"]
        assert d["fraction_in_runs_of_1"] > s["fraction_in_runs_of_1"]
        assert d["prefix_discrepancy"] < s["prefix_discrepancy"]
        # quarter shares and bucket ends: both sit at one-batch granularity; a lucky stride seed can
        # land a batch closer, never by a whole batch
        assert d["quarter_max_dev_pp"] < s["quarter_max_dev_pp"] + one_batch_pp
        assert d["earliest_bucket_end"] > s["earliest_bucket_end"] - 1 / n
        assert d["earliest_bucket_end"] >= (n - 8) / n  # 6 buckets end within the last few positions


def test_default_reaches_the_least_possible_longest_run_on_random_counts():
    rng = np.random.default_rng(7)
    for _ in range(150):
        k = int(rng.integers(1, 9))
        counts = rng.integers(0, 2500, size=k)
        if rng.random() < 0.3:  # one bucket over half: runs are forced
            counts[0] = int(rng.integers(1, 5)) * counts.sum() + 1
        order = interleave_order(counts, seed=int(rng.integers(0, 100)))
        m = order_measures(order, k)
        assert np.bincount(order, minlength=k).tolist() == counts.tolist()
        assert m["longest_run"] == m["least_possible_longest_run"], counts
        assert m["prefix_discrepancy"] <= 2.0 if m["least_possible_longest_run"] == 1 else True


def test_dominant_bucket_is_spread_evenly():
    counts = [100, 50, 850]  # 85%: runs of ceil(850 / 151) = 6 are forced
    m = order_measures(interleave_order(counts, seed=0), 3)
    assert m["least_possible_longest_run"] == 6 and m["longest_run"] == 6
    assert m["quarter_max_dev_pp"] < 1.0


def test_sequential_and_diversity_show_the_failures_the_default_fixes():
    seq = order_measures(interleave_order(SEED_RUN, strategy="sequential"), 6)
    assert seq["longest_run"] == max(SEED_RUN) and seq["earliest_bucket_end"] < 0.05
    div = order_measures(interleave_order(SEED_RUN, strategy="diversity", seed=0), 6)
    # never the previous bucket while several remain, but small buckets run out early
    assert div["earliest_bucket_end"] < 0.9 and div["quarter_max_dev_pp"] > 5
    order = interleave_order(SEED_RUN, strategy="diversity", seed=0)
    head = order[: int(0.5 * order.size)]
    assert (head[1:] != head[:-1]).all()


def test_measures_on_a_known_order():
    m = order_measures(np.array([0, 0, 1, 0, 1, 1, 1, 0]), 2)
    assert m["longest_run"] == 3
    assert m["run_length_hist"] == {1: 3, 2: 1, 3: 1}  # [0 0] [1] [0] [1 1 1] [0]
    assert m["fraction_in_runs_of_1"] == pytest.approx(3 / 8)
    assert m["last_batch_fraction"] == [1.0, 7 / 8]
    assert m["prefix_discrepancy"] == pytest.approx(1.0)  # e.g. after 2 batches: two 0s, one expected
    assert m["quarter_share"][0] == [1.0, 0.0]


def test_bad_counts_are_rejected():
    with pytest.raises(ValueError):
        interleave_order([3, -1])
    with pytest.raises(ValueError):
        interleave_order([3, 1], strategy="nope")
    assert interleave_order([0, 0]).size == 0
