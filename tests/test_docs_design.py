"""The design lives in the project and the docs say one true thing about hub downloads.

The README must point at no file outside the repository; docs/design.md names only paths that exist; the
README and docs/clusters.md agree with dflash_ray/paths.py (the code, exercised here with a fake hub) that a
hub id is downloaded when the hub is reachable, and both say that several nodes need a shared HF_HOME."""
import re
from pathlib import Path

import pytest

from dflash_ray.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CLUSTERS = (ROOT / "docs" / "clusters.md").read_text()


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_readme_points_at_nothing_outside_the_repository():
    outside = re.findall(r"`(\.\./[^`]*)`|\]\((\.\./[^)]*)\)", README)
    assert not outside, outside
    assert "(docs/design.md)" in README


def test_the_design_page_names_only_paths_that_exist():
    text = (ROOT / "docs" / "design.md").read_text()
    # every `path/like/this.py` or `dir/` in backquotes, and the file names in the data-flow diagram
    named = set(re.findall(r"`((?:dflash_ray|conf|docs|tests|jobs|scripts|benchmarks)/[\w./-]*)`", text))
    named |= {f"dflash_ray/{p}" for p in re.findall(r"\b((?:data|model|sizing|demo|runtime)/[\w/]+\.py)\b", text)}
    assert len(named) > 30, named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing
    for part in ("## Data flow", "## The parts", "## Invariants"):
        assert part in text
    for room in ("stream/", "training/", "record/", "jobs/"):     # the runtime's rooms, as the code has them
        assert f"`{room}`" in text and (ROOT / "dflash_ray" / "runtime" / room).is_dir()


def test_hub_ids_are_downloaded_when_reachable_and_the_docs_say_so(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from dflash_ray.paths import resolve_model_dir

    calls = []

    def fake_snapshot_download(repo_id, local_files_only=False, **kw):
        calls.append(local_files_only)
        if local_files_only:
            raise LocalEntryNotFoundError("not in the cache")
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert resolve_model_dir("Qwen/Qwen3-8B", "model.target_path") == str(tmp_path / "snapshot")
    assert calls == [True, False]        # the cache first, then a download
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="model.target_path"):
        resolve_model_dir("Qwen/Qwen3-8B", "model.target_path")
    # so the docs must not say that nothing is downloaded, and both say what several nodes need
    for name, text in (("README.md", _flat(README)), ("docs/clusters.md", _flat(CLUSTERS))):
        assert "nothing is downloaded" not in text, name
        assert re.search(r"downloaded first when (it is not there and )?the hub is reachable", text), name
        assert "shared `HF_HOME`" in text, name
