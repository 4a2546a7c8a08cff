"""Models named by a Hugging Face hub id resolve through the local hub cache; a miss is one line."""
import json
import os
import subprocess
from pathlib import Path
import sys

from helpers_data import write_shard

from dflash_ray.paths import is_hub_id

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def test_what_counts_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "target").mkdir(parents=True)
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("meta-llama/Llama-3.1-8B-Instruct")
    assert not is_hub_id("runs/target")            # an existing relative path wins
    assert not is_hub_id("/models/Qwen3-8B") and not is_hub_id("s3://bucket/model") and not is_hub_id("a/b/c")


def _cli(args, env):
    return subprocess.run([sys.executable, "-m", "dflash_ray", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_a_hub_id_in_the_local_cache_is_used(tmp_path):
    # the cache layout huggingface_hub writes: models--owner--name/{refs/main, snapshots/<commit>/...}
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-8B"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(QWEN3_8B))
    write_shard(tmp_path / "shards" / "a.parquet", list(range(8)), [600] * 8)
    proc = _cli(["plan", "model=qwen3_8b", "data=sharegpt", "model.target_path=Qwen/Qwen3-8B", "data.tokenizer=x",
                 f"data.shards={tmp_path / 'shards'}", "cluster=8gpu"], {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    # the memory model read the cached config.json: Qwen3-8B's untied bf16 embedding + head, 2.32 GiB
    assert "frozen embed/head 2.32 GiB" in proc.stdout


def test_a_hub_id_missing_from_the_cache_offline_is_one_line(tmp_path):
    proc = _cli(["plan", "model=qwen3_8b", "data=sharegpt", "model.target_path=Qwen/Qwen3-8B", "data.tokenizer=x",
                 f"data.shards={tmp_path}"], {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "config key 'model.target_path': Qwen/Qwen3-8B is not in the local Hugging Face cache" \
        in lines[0], proc.stderr


def test_shards_at_a_filesystem_uri_read_as_the_local_path(tmp_path):
    # file:// stands in for s3:// / gs:// here (the same pyarrow filesystem layer; no object store reachable)
    import numpy as np

    from dflash_ray.config import compose_config
    from dflash_ray.data.plan import plan_from_config
    from dflash_ray.data.shards import read_all

    write_shard(tmp_path / "s" / "a.parquet", list(range(10)), [40 + 7 * i for i in range(10)])
    write_shard(tmp_path / "s" / "b.parquet", list(range(10, 16)), [300] * 6, seed=1)
    local, uri = str(tmp_path / "s"), f"file://{tmp_path / 's'}"
    a = plan_from_config(compose_config([f"data.shards={local}"]))
    b = plan_from_config(compose_config([f"data.shards={uri}"]))
    assert np.array_equal(a.sample_ids, b.sample_ids) and np.array_equal(a.offsets, b.offsets)
    assert read_all(uri).equals(read_all(local))


def test_a_missing_or_unknown_shard_location_is_one_line(tmp_path):
    import pytest

    from dflash_ray.data.shards import list_shards
    from dflash_ray.errors import UserError

    with pytest.raises(UserError, match=r"file://.*/nowhere: shard directory does not exist"):
        list_shards(f"file://{tmp_path}/nowhere")
    with pytest.raises(UserError, match=r"nosuch://bucket/x: cannot open this location"):
        list_shards("nosuch://bucket/x")


def test_prompts_at_a_filesystem_uri(tmp_path):
    from dflash_ray.data.prompts import read_prompts

    (tmp_path / "p.jsonl").write_text("[1, 2, 3]\n{\"input_ids\": [4, 5]}\n")
    assert read_prompts(f"file://{tmp_path / 'p.jsonl'}", None, 10) == [[1, 2, 3], [4, 5]]


def test_a_python_without_the_project_says_so_in_one_line(tmp_path):
    # what a job gets when the cluster was started outside the project's environment: a bare Python
    import venv

    venv.EnvBuilder(with_pip=False).create(tmp_path / "bare")
    bare = tmp_path / "bare" / "bin" / "python"
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([str(bare), "-m", "dflash_ray.train"], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo)})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "cannot import omegaconf" in lines[0] and "scripts/ray-start.sh" in lines[0]
