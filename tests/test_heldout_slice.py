"""A real run's held-out slice (data.heldout_fraction): `prepare` keeps a share of the conversations, by id,
out of the shards and writes their prompts beside them; the main job measures tau on those prompts when
no data.prompts is given. Held out means never trained: no held-out conversation has a row in the shards."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers_data import make_tokenizer, write_jsonl
from transformers import AutoTokenizer

from dflash_ray.cli import run_command
from dflash_ray.config import compose_config
from dflash_ray.data.prepare import HELDOUT, TURN_STRIDE, prepare
from dflash_ray.data.prompts import read_prompts
from dflash_ray.data.shards import list_shards
from dflash_ray.errors import UserError

N = 240


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("heldout")
    _, tokdir = make_tokenizer(root)
    rows = []
    for i in range(N):
        conv = [{"role": "user", "content": f"Count from {i % 7} to {i % 7 + 30}."},
                {"role": "assistant", "content": " ".join(map(str, range(i % 7, i % 7 + 31)))}]
        if i % 3 == 0:   # a second exchange: the prompt keeps the history up to the last user turn
            conv += [{"role": "user", "content": "Again, backwards."},
                     {"role": "assistant", "content": " ".join(map(str, range(i % 7 + 30, i % 7 - 1, -1)))}]
        rows.append({"id": f"c{i}", "conversations": conv})
    return root, tokdir, rows, write_jsonl(root / "conversations.jsonl", rows)


def _trained_ids(out) -> set[int]:
    ids = np.concatenate([pq.read_table(f.path, columns=["sample_id"]).column(0).to_numpy() for f in list_shards(out)])
    return set((ids // TURN_STRIDE).tolist())


def test_a_share_of_the_conversations_is_held_out_and_never_trained(corpus, tmp_path):
    root, tokdir, rows, src = corpus
    s = prepare(str(src), str(tokdir), str(tmp_path / "a"), shard_size=50, heldout_fraction=0.25, progress=False)
    held = [json.loads(line) for line in (tmp_path / "a" / HELDOUT).read_text().splitlines()]
    held_ids = [r["id"] for r in held]
    trained = _trained_ids(tmp_path / "a")
    assert set(held_ids).isdisjoint(trained) and set(held_ids) | trained == set(range(N))
    assert held_ids == sorted(held_ids) and len(held) == len(s.heldout)
    # 240 conversations at 25%: 60 expected, sd 6.7; a slice outside 30..90 would not be a 25% share
    assert 30 <= len(held) <= 90
    for r in held:   # each prompt: the conversation up to its last user turn, nothing the target answered last
        conv = rows[r["id"]]["conversations"]
        last_user = max(i for i, m in enumerate(conv) if m["role"] == "user")
        assert r["conversations"] == conv[:last_user + 1]
    # the same slice whatever the shard size (the hash of the id decides, not the position in a shard)
    prepare(str(src), str(tokdir), str(tmp_path / "b"), shard_size=7, heldout_fraction=0.25, progress=False)
    assert (tmp_path / "b" / HELDOUT).read_bytes() == (tmp_path / "a" / HELDOUT).read_bytes()
    # a larger share holds out a superset: growing the slice never moves a held-out conversation back
    prepare(str(src), str(tokdir), str(tmp_path / "c"), shard_size=50, heldout_fraction=0.5, progress=False)
    more = {json.loads(line)["id"] for line in (tmp_path / "c" / HELDOUT).read_text().splitlines()}
    assert set(held_ids) < more


def test_no_share_writes_no_prompts_and_a_whole_share_is_refused(corpus, tmp_path, capsys):
    root, tokdir, rows, src = corpus
    prepare(str(src), str(tokdir), str(tmp_path / "none"), shard_size=500, progress=False)
    assert not (tmp_path / "none" / HELDOUT).exists() and _trained_ids(tmp_path / "none") == set(range(N))
    assert run_command("prepare", [f"data.input={src}", f"data.tokenizer={tokdir}", f"data.output={tmp_path}/o",
                                   "data.heldout_fraction=1"]) == 2
    assert "config key 'data.heldout_fraction'" in capsys.readouterr().err


def test_a_real_runs_data_holds_out_and_the_demo_does_not():
    assert compose_config(["data=sharegpt"]).data.heldout_fraction == 0.01
    assert compose_config([]).data.heldout_fraction == 0.0   # the demo world holds out a corpus of its own


def test_the_held_out_prompts_render_as_served(corpus, tmp_path):
    """read_prompts renders a held-out row with the chat template's generation prompt, as the tokenizer
    itself renders the conversation up to the last user turn."""
    root, tokdir, rows, src = corpus
    prepare(str(src), str(tokdir), str(tmp_path / "p"), shard_size=500, heldout_fraction=0.25, progress=False)
    tok = AutoTokenizer.from_pretrained(str(tokdir))
    held = [json.loads(line) for line in (tmp_path / "p" / HELDOUT).read_text().splitlines()]
    prompts = read_prompts(str(tmp_path / "p" / HELDOUT), tok, limit=1000)
    assert len(prompts) == len(held)
    for ids, r in zip(prompts, held):
        want = tok.apply_chat_template(r["conversations"], tokenize=True, add_generation_prompt=True, return_dict=False)
        assert list(ids) == list(want)


def test_the_main_job_measures_tau_on_the_held_out_slice_when_no_prompts_are_given(corpus, tmp_path):
    from dflash_ray.runtime.spec import _heldout_prompts

    root, tokdir, rows, src = corpus
    out = tmp_path / "shards"
    prepare(str(src), str(tokdir), str(out), shard_size=500, heldout_fraction=0.25, progress=False)
    d = compose_config([f"data.shards={out}"]).data
    assert _heldout_prompts(d) == str((out / HELDOUT).resolve())
    own = write_jsonl(tmp_path / "mine.jsonl", [[1, 2, 3]])
    assert _heldout_prompts(compose_config([f"data.shards={out}", f"data.prompts={own}"]).data) == str(own.resolve())
    assert _heldout_prompts(compose_config([f"data.shards={tmp_path}"]).data) is None   # nothing held out there


def test_bad_held_out_share_type_is_one_line():
    with pytest.raises(UserError, match="data.heldout_fraction"):
        compose_config(["data.heldout_fraction=lots"])
