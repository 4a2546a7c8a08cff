"""The demo world's tokenizer and trained target as the package ships them (dflash_ray/demo/shipped/): the
embedded default builds its world from them instead of training a target of its own, so the world is the
same on every processor; a config whose world is made from anything else trains its own, as before.

No Ray: regeneration is off here. The regenerated corpus and plan through Ray are compared with the
recorded fingerprint by test_demo_learns, which runs the default world."""
from __future__ import annotations

import json

import pytest

from dflash_ray.config import compose_config
from dflash_ray.demo import shipped
from dflash_ray.demo.world import SHIPPED, WORLD_JSON, make_demo_inputs, shipped_world, use_shipped, write_generated
from dflash_ray.machine_cache import file_digest

RECORD = json.loads((SHIPPED / WORLD_JSON).read_text())


def files(root):
    return {str(p.relative_to(root)): file_digest(p) for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_default_config_is_made_from_what_the_shipped_world_was():
    assert shipped_world(compose_config([])) == RECORD, (
        "the embedded default's world is no longer what the shipped target was made from: "
        "run scripts/build-demo-world.sh and commit dflash_ray/demo/shipped/")
    assert RECORD["fingerprint"] is not None, "world.json has no fingerprint: run scripts/build-demo-world.sh"


@pytest.mark.parametrize("override", ["seed=1", "data.synthetic.num_conversations=400", "data.synthetic.max_tokens=256",
                                      "data.synthetic.target_steps=300", "model.target_config.hidden_size=96",
                                      "data.synthetic.corpus=instructions"])
def test_a_world_made_from_anything_else_is_not_the_shipped_one(override):
    assert shipped_world(compose_config([override])) is None


def test_the_default_world_copies_the_shipped_target_and_trains_none(tmp_path):
    cfg = compose_config([f"run.root={tmp_path / 'runs'}", "run.name=a", f"data.synthetic.cache_dir={tmp_path / 'cache'}",
                          "data.synthetic.regenerate=false", "data.synthetic.heldout_prompts=4"])
    lines = []
    make_demo_inputs(cfg, log=lines.append)
    assert not any("trained the target" in line for line in lines), lines
    assert any("the package's trained target (1200 steps" in line for line in lines), lines
    run = tmp_path / "runs" / "a"
    # the corpus this machine generated is the one the shipped target was trained on (numpy's generator,
    # not float sums: the same bytes on any processor)
    assert file_digest(run / "corpus.jsonl") == RECORD["corpus_sha256"]
    assert files(run / "target") == files(SHIPPED / "target")
    assert files(run / "tokenizer") == files(SHIPPED / "tokenizer")
    assert cfg.model.target_path == str(run / "target")


def test_a_corpus_other_than_the_recorded_one_gets_no_shipped_target(tmp_path):
    cfg = compose_config([])
    corpus = tmp_path / "corpus.jsonl"
    write_generated(cfg, corpus, 600, split="train")
    corpus.write_bytes(corpus.read_bytes().replace(b'"user"', b'"user" ', 1))   # one byte more
    lines = []
    assert not use_shipped(cfg, corpus, tmp_path / "tok", tmp_path / "target", log=lines.append)
    assert not (tmp_path / "target").exists() and "training a target here" in lines[0]


def test_the_regenerated_fingerprint_reads_tokens_not_bytes(tmp_path):
    rows = [{"id": "b", "conversations": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y z"}]},
            {"id": "a", "conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}]
    one, two, three = tmp_path / "1.jsonl", tmp_path / "2.jsonl", tmp_path / "3.jsonl"
    one.write_text("".join(json.dumps(r) + "\n" for r in rows))
    two.write_text("".join(json.dumps(r, indent=None, separators=(",", ":"), sort_keys=True) + "\n" for r in rows[::-1]))
    rows[0]["conversations"][1]["content"] = "y w"
    three.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert shipped.regenerated_fingerprint(one) == shipped.regenerated_fingerprint(two)
    assert shipped.regenerated_fingerprint(one) != shipped.regenerated_fingerprint(three)
