"""`dflash-ray push REPO_ID`: what runs without a network. The folder must be an export (config.json,
model.safetensors, README.md); a bad repo id, no token, or an unreachable hub (HF_ENDPOINT at a local port
nothing listens on) each give one line on stderr and exit code 2, through the real CLI, and leave the export
as it was. The upload itself (huggingface_hub's create_repo + upload_folder against the real hub) is not
run here: no network."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_ray.errors import UserError
from dflash_ray.model.drafter import DrafterConfig, build_drafter
from dflash_ray.model.export import export_drafter
from dflash_ray.model.target import build_synthetic_target, load_embed_and_head, load_target
from dflash_ray.publish import EXPORT_FILES, push, take_export_override
from helpers_model import TINY_QWEN3

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("publish")
    tdir = build_synthetic_target({**TINY_QWEN3, "num_hidden_layers": 4}, 300, str(root / "target"), seed=0)
    embed, head = load_embed_and_head(tdir)
    drafter = build_drafter(DrafterConfig(num_draft_layers=1, block_size=4, num_anchors=4, mask_token_id=299),
                            load_target(tdir).config, embed, head, seed=0)
    return Path(export_drafter(drafter, str(root / "runs" / "r" / "export"), dtype=torch.bfloat16,
                               card={"target": "Qwen/Qwen3-8B", "steps": 7}))


def closed_port() -> int:
    """A local port nothing listens on (bound, then released): a connection there is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(args, tmp_path, **env):
    """`python -m dflash_ray push ...` with no stored token (HF_HOME in tmp) and no hub reachable."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    base.update(HF_HOME=str(tmp_path / "hf_home"), HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}",
                HF_HUB_DISABLE_TELEMETRY="1", **env)
    return subprocess.run([sys.executable, "-m", "dflash_ray", "push", *args], cwd=REPO, env=base,
                          capture_output=True, text=True, timeout=300)


def snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_the_export_holds_what_push_publishes(export_dir):
    assert sorted(os.listdir(export_dir)) == sorted(EXPORT_FILES)


@pytest.mark.parametrize("missing", EXPORT_FILES)
def test_a_folder_that_is_not_an_export_is_refused(export_dir, tmp_path, missing):
    folder = tmp_path / "partial"
    shutil.copytree(export_dir, folder)
    (folder / missing).unlink()
    with pytest.raises(UserError, match=f"not an export of dflash-ray \\(missing {missing};"):
        push(str(folder), "someone/drafter", token="hf_not_a_real_token")


def test_export_dir_is_pushs_argument_not_a_config_key():
    assert take_export_override(["run.name=a", "export=/x/y", "seed=1"]) == (["run.name=a", "seed=1"], "/x/y")
    assert take_export_override(["run.name=a"]) == (["run.name=a"], None)
    with pytest.raises(UserError, match="export=DIR"):
        take_export_override(["export="])


def test_an_unreachable_hub_is_one_line_and_exit_2(export_dir, tmp_path):
    before = snapshot(export_dir)
    out = cli(["someone/drafter", f"export={export_dir}"], tmp_path, HF_TOKEN="hf_not_a_real_token")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("dflash-ray push: error: the hub at http://127.0.0.1:")
    assert "could not be reached" in lines[0]
    assert snapshot(export_dir) == before  # the card is rewritten only once the hub has answered


def test_no_token_is_one_line_and_exit_2(export_dir, tmp_path):
    out = cli(["someone/drafter", f"export={export_dir}"], tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "dflash-ray push: error: no Hugging Face token: log in with `hf auth login`, or set HF_TOKEN"]


def test_a_bad_repo_id_is_one_line_and_exit_2(export_dir, tmp_path):
    out = cli(["drafter-without-owner", f"export={export_dir}"], tmp_path, HF_TOKEN="hf_not_a_real_token")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "dflash-ray push: error: repo id 'drafter-without-owner': give it as OWNER/NAME (your user or "
        "organisation, then the name)"]


def test_the_default_export_is_the_runs(export_dir, tmp_path):
    """Without export=DIR, push takes <run.dir>/export of the composed config."""
    runs = export_dir.parent.parent
    out = cli(["someone/drafter", f"run.root={runs}", "run.name=missing"], tmp_path, HF_TOKEN="hf_x")
    assert out.returncode == 2
    assert out.stderr.strip() == f"dflash-ray push: error: {runs}/missing/export: no such directory (an export: " \
                                 "`dflash-ray export`, or export=DIR)"
    out = cli(["someone/drafter", f"run.root={runs}", "run.name=r"], tmp_path, HF_TOKEN="hf_x")
    assert out.returncode == 2 and "could not be reached" in out.stderr  # found the export, then the hub
