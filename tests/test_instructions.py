"""The instruction prompt set (dflash_ray/data/instructions.py): enough distinct prompts, deterministic, the
held-out split apart from train in kinds and topics, a multi-turn share, every train kind present, rows the
data layer reads, a length cue in every user turn. Fast: no Ray, no model."""
import json
import re

import pytest

from dflash_ray.data.formats import iter_conversations
from dflash_ray.data.instructions import (HELDOUT_KINDS, HELDOUT_TOPICS, LENGTH_CUES, PLACEHOLDER, TRAIN_KINDS,
                                          TRAIN_TOPICS, write_instructions)

N = 1200


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    path = write_instructions(tmp_path_factory.mktemp("instr") / "sub" / "train.jsonl", N, seed=0)
    return path, [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
    path = write_instructions(tmp_path_factory.mktemp("instr") / "heldout.jsonl", 300, seed=0, split="heldout")
    return path, [json.loads(line) for line in path.read_text().splitlines()]


def users(row) -> list[str]:
    return [m["content"] for m in row["conversations"] if m["role"] == "user"]


def names(text: str, phrase: str) -> bool:
    """`phrase` as whole words in `text` (case-insensitive): "sleep" is not named by "sleepwalking"."""
    return re.search(r"(?<!\w)" + re.escape(phrase.lower()) + r"(?!\w)", text.lower()) is not None


def test_count_and_distinct_first_turns(train):
    _, rows = train
    assert len(rows) == N
    assert [r["id"] for r in rows] == [f"instr-train-{i}" for i in range(N)]
    firsts = {users(r)[0] for r in rows}
    assert len(firsts) >= 1000, len(firsts)


def test_deterministic(tmp_path, train):
    path, _ = train
    again = write_instructions(tmp_path / "again.jsonl", N, seed=0)
    assert again.read_bytes() == path.read_bytes()
    other = write_instructions(tmp_path / "other.jsonl", N, seed=1)
    assert other.read_bytes() != path.read_bytes()


def test_splits_apart(train, heldout):
    assert not set(TRAIN_KINDS) & set(HELDOUT_KINDS) and not set(TRAIN_TOPICS) & set(HELDOUT_TOPICS)
    _, train_rows = train
    _, held_rows = heldout
    assert {r["id"] for r in held_rows} == {f"instr-heldout-{i}" for i in range(300)}
    for r in train_rows:
        assert r["kind"] in TRAIN_KINDS and r["topic"] in TRAIN_TOPICS, r
        for text in users(r):
            assert not [t for t in HELDOUT_TOPICS if names(text, t)], (text, r["kind"])
    for r in held_rows:
        assert r["kind"] in HELDOUT_KINDS and r["topic"] in HELDOUT_TOPICS, r
        assert names(users(r)[0], r["topic"]), r  # the topic is really in the prompt
        for text in users(r):
            assert not [t for t in TRAIN_TOPICS if names(text, t)], (text, r["kind"])
    assert {r["kind"] for r in held_rows} == set(HELDOUT_KINDS)
    # no held-out prompt is a train prompt
    assert not {u for r in held_rows for u in users(r)[:1]} & {u for r in train_rows for u in users(r)[:1]}


def test_multi_turn_share_and_system_prompts(train):
    _, rows = train
    multi = sum(len(users(r)) == 2 for r in rows) / len(rows)
    assert 0.2 <= multi <= 0.4, multi
    assert all(len(users(r)) in (1, 2) for r in rows)
    system = sum(r["conversations"][0]["role"] == "system" for r in rows) / len(rows)
    assert 0.04 <= system <= 0.2, system


def test_every_train_kind_appears(train):
    _, rows = train
    assert {r["kind"] for r in rows} == set(TRAIN_KINDS)
    assert len(TRAIN_KINDS) >= 10 and len(HELDOUT_KINDS) >= 3


def test_rows_read_by_the_data_layer(train, heldout):
    for path, rows in (train, heldout):
        convs = list(iter_conversations(str(path), on_bad_row="fail", keep_fields=True))
        assert len(convs) == len(rows)
        for conv, row in zip(convs, rows):
            roles = [m["role"] for m in conv.messages]
            if roles[0] == "system":
                roles = roles[1:]
            assert roles == ["user", "assistant"] * (len(roles) // 2) and roles, roles
            assert all(m["content"] == PLACEHOLDER for m in conv.messages if m["role"] == "assistant")
            assert conv.fields["kind"] == row["kind"] and conv.fields["id"] == row["id"]


def test_every_user_turn_has_a_length_cue(train, heldout):
    for _, rows in (train, heldout):
        for r in rows:
            for text in users(r):
                assert any(c in text.lower() for c in LENGTH_CUES), (r["kind"], text)
    # the cues ask for short answers, and the prompts are short too (the target runs on CPUs)
    lengths = [len(users(r)[0].split()) for r in train[1]]
    assert max(lengths) <= 120 and sum(lengths) / len(lengths) <= 40


def test_bad_split(tmp_path):
    with pytest.raises(ValueError, match="split"):
        write_instructions(tmp_path / "x.jsonl", 10, split="validation")
    assert not (tmp_path / "x.jsonl").exists()
