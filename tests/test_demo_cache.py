"""The demo world built once per machine (demo/world.py, machine_cache.py): a second run with another name
copies the cached world instead of training the target again; an entry damaged in any way is found and
built again, equal to the first build; what the world is not made from does not change its key.

No Ray here: regeneration is off (data.synthetic.regenerate=false), the rest of the world is the default's
(corpus, tokenizer, target trained a few steps, held-out prompts); the Ray regeneration inside a cached
build is covered by the demo runs (test_demo_learns, test_first_run)."""
from __future__ import annotations

import json
import threading

import pytest

from dflash_ray.config import compose_config
from dflash_ray.demo.world import WORLD_FILES, demo_world_entry, make_demo_inputs
from dflash_ray.machine_cache import KeyedEntry, file_digest
from dflash_ray.runtime.record.phases import PhaseClock

SMALL = ["data.synthetic.num_conversations=40", "data.synthetic.max_tokens=128", "data.synthetic.regenerate=false",
         "data.synthetic.target_steps=3", "data.synthetic.heldout_prompts=4"]


def config(tmp_path, name, extra=()):
    return compose_config([f"run.root={tmp_path / 'runs'}", f"run.name={name}",
                           f"data.synthetic.cache_dir={tmp_path / 'cache'}", *SMALL, *extra])


def make(cfg):
    lines, clock = [], PhaseClock()
    make_demo_inputs(cfg, log=lines.append, clock=clock)
    return lines, [r["phase"] for r in clock.rows]


def digests(root):
    return {str(p.relative_to(root)): file_digest(p) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache")
    cfg = config(tmp, "a")
    lines, phases = make(cfg)
    return tmp, cfg, lines, phases


def test_a_second_run_copies_the_cached_world_and_trains_no_target(first):
    tmp, a, lines_a, phases_a = first
    assert any("building it" in line for line in lines_a)
    assert "demo world (cache)/target" in phases_a and any("trained the target 3 steps" in line for line in lines_a)
    b = config(tmp, "b")
    lines_b, phases_b = make(b)
    assert not any("trained the target" in line or "building" in line for line in lines_b), lines_b
    assert any("cached at" in line for line in lines_b)
    assert "demo world (cache)/target" not in phases_b and "prepare" in phases_b
    # the config points at the run's own copies, equal byte for byte to the first run's
    run_a, run_b = tmp / "runs" / "a", tmp / "runs" / "b"
    assert b.model.target_path == str(run_b / "target") and b.data.tokenizer == str(run_b / "tokenizer")
    assert b.data.input == str(run_b / "corpus.jsonl") and b.data.prompts == str(run_b / "heldout.jsonl")
    for name in ("corpus.jsonl", "tokenizer", "target", "heldout.jsonl"):
        assert digests(run_b / name) == digests(run_a / name) if (run_a / name).is_dir() else \
            file_digest(run_b / name) == file_digest(run_a / name)
    # each run prepared its own shards
    assert (run_b / "shards").is_dir() and b.data.shards == str(run_b / "shards")


def test_the_entry_records_every_file_it_holds(first):
    tmp, a, _, _ = first
    entry = demo_world_entry(config(tmp, "a"))   # of a config as given (a run fills its nulls)
    record = json.loads((entry.path / KeyedEntry.RECORD).read_text())
    held = {k: v for k, v in digests(entry.path).items() if k != KeyedEntry.RECORD}
    assert {k: v[1] for k, v in record["files"].items()} == held
    assert {k.split("/")[0] for k in held} <= set(WORLD_FILES)
    assert record["what"]["seed"] == a.seed and record["what"]["synthetic"]["target_steps"] == 3


@pytest.mark.parametrize("damage", ["truncate weights", "delete tokenizer", "no record"])
def test_a_damaged_entry_is_built_again_equal_to_the_first(first, damage):
    tmp, _, _, _ = first
    entry = demo_world_entry(config(tmp, "a"))
    before = digests(entry.path)
    if damage == "truncate weights":
        weights = entry.path / "target" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
        expected = "target/model.safetensors differs"
    elif damage == "delete tokenizer":
        (entry.path / "tokenizer" / "tokenizer.json").unlink()
        expected = "tokenizer/tokenizer.json is missing"
    else:
        (entry.path / KeyedEntry.RECORD).unlink()
        expected = "did not finish"
    assert expected in entry.problem()
    lines, phases = make(config(tmp, f"after-{damage.replace(' ', '-')}"))
    assert any("damaged" in line and expected in line for line in lines), lines
    assert "demo world (cache)/target" in phases            # built again, the target trained again
    assert entry.problem() is None
    after = digests(entry.path)
    # the same world: the build is deterministic at a seed (but for the seconds the records and the target's
    # training marker hold); the marker's figures other than its time are the same
    timed = {KeyedEntry.RECORD, "target/dflash_demo_training.json"}
    assert {k: v for k, v in after.items() if k not in timed} == {k: v for k, v in before.items() if k not in timed}
    assert set(after) == set(before)
    marker = json.loads((entry.path / "target" / "dflash_demo_training.json").read_text())
    assert marker["steps"] == 3 and marker["final_loss"] > 0


def test_a_run_that_has_its_world_keeps_it_without_the_cache(first):
    """A restart of a run reads its own directory's world, whatever happened to the cache since."""
    import shutil

    tmp, a, _, _ = first
    shutil.rmtree(tmp / "cache")
    again = config(tmp, "a")
    lines, phases = make(again)
    assert not any("building" in line or "cached at" in line for line in lines), lines
    assert not (tmp / "cache").exists() and again.model.target_path == str(tmp / "runs" / "a" / "target")


def test_the_key_follows_what_the_world_is_made_from(tmp_path):
    key = lambda *extra: demo_world_entry(config(tmp_path, "k", extra)).key  # noqa: E731
    base = key()
    assert key("train.lr=1e-4", "train.epochs=2", "run.name=other", "data.bucket_boundaries=[64,128]") == base
    for changed in ("seed=1", "data.synthetic.num_conversations=41", "data.synthetic.target_steps=4",
                    "model.target_config.hidden_size=32", "regenerate.max_new_tokens=100",
                    "data.synthetic.corpus=instructions"):
        assert key(changed) != base, changed
    # a world the run does not make whole is not cached; nor when the cache is off
    assert demo_world_entry(config(tmp_path, "k", ["model.target_path=/some/target"])) is None
    assert demo_world_entry(config(tmp_path, "k", ["data.synthetic.cache=false"])) is None


def test_two_builders_of_one_entry_build_it_once(tmp_path):
    entry, built = KeyedEntry(tmp_path, {"x": 1}), []

    def builder():
        with entry.lock():
            if entry.problem() is not None:
                entry.build(lambda d: (built.append(1), (d / "f").write_text("x")))

    threads = [threading.Thread(target=builder) for _ in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert built == [1] and entry.problem() is None and (entry.path / "f").read_text() == "x"


def test_an_entry_whose_file_keeps_its_size_but_not_its_bytes_is_damaged(tmp_path):
    """The record's sha256 is checked, not only the size: a file rewritten in place with other bytes of the
    same length (a flipped bit, an editor's save) makes the entry damaged, so it is built again."""
    entry = KeyedEntry(tmp_path, {"x": 1})
    entry.build(lambda d: ((d / "weights.bin").write_bytes(bytes(range(256))), (d / "sub").mkdir(),
                           (d / "sub" / "f.txt").write_text("abc")))
    assert entry.problem() is None
    weights = entry.path / "weights.bin"
    flipped = bytearray(weights.read_bytes())
    flipped[100] ^= 1                                            # one bit, the length unchanged
    weights.write_bytes(bytes(flipped))
    assert weights.stat().st_size == 256
    assert entry.problem() == "damaged: weights.bin differs from the entry's record"
    (entry.path / "sub" / "f.txt").write_text("abd")             # also inside a folder
    weights.write_bytes(bytes(range(256)))
    assert entry.problem() == "damaged: sub/f.txt differs from the entry's record"
