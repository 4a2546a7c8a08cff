"""The configuration reference: docs/configuration.md is what `dflash-ray config --markdown` prints (regenerate
it after changing a key: `dflash-ray config --markdown > docs/configuration.md`); every key of the schema has a
line, every group option a summary; the reference says of a key what composition does with it (its default,
its choices, its minimum), checked against composition itself and the schema's source."""
import ast
from pathlib import Path

import pytest

from dflash_ray.cli import main
from dflash_ray.config import CONF_DIR, compose_config, reference_markdown, schema_keys
from dflash_ray.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def test_docs_configuration_is_the_generated_reference():
    assert (ROOT / "docs" / "configuration.md").read_text() == reference_markdown(), (
        "docs/configuration.md is stale: dflash-ray config --markdown > docs/configuration.md")


def test_every_key_says_what_it_is_and_every_option_has_a_summary():
    keys = schema_keys()
    assert len(keys) > 100
    assert [k.key for k in keys if len(k.doc) < 10] == []
    # every field of the schema's source is a knob or a group: nothing declared without its line
    tree = ast.parse((ROOT / "dflash_ray" / "config.py").read_text())
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Config")):
        for f in (n for n in cls.body if isinstance(n, ast.AnnAssign)):
            assert isinstance(f.value, ast.Call) and f.value.func.id in ("knob", "group"), (cls.name, f.target.id)
    for option in CONF_DIR.glob("*/*.yaml"):
        first = next(x for x in option.read_text().splitlines() if x.startswith("#") and "@package" not in x)
        assert first.endswith(".") and len(first) <= 110, option


def _line(capsys, key):
    """The key's entry in `dflash-ray config KEY`, its wrapped lines joined."""
    assert main(["config", key]) == 0
    entries = " ".join(x.strip() if x.startswith(" ") else "\n" + x for x in capsys.readouterr().out.splitlines())
    return next(x for x in entries.split("\n") if x.startswith(key + " ")).strip()


def test_the_reference_says_what_composition_does(capsys):
    # the default of a key no option of the default config sets, as composition gives it
    assert _line(capsys, "train.grad_clip").startswith(f"train.grad_clip (float, default {compose_config([]).train.grad_clip}):")
    # choices: the ones composition accepts and names when it refuses one
    line = _line(capsys, "data.interleave")
    with pytest.raises(UserError) as refused:
        compose_config(["data.interleave=bogus"])
    named = str(refused.value).split("is not one of ")[1]
    assert line.endswith(f"[one of {named}]"), (line, named)
    for choice in named.split(", "):
        compose_config([f"data.interleave={choice}"])
    # a minimum: refused below it, accepted at it
    assert _line(capsys, "train.epochs").endswith("[>= 1]")
    with pytest.raises(UserError, match="must be >= 1"):
        compose_config(["train.epochs=0"])
    compose_config(["train.epochs=1"])


def test_a_prefix_lists_its_keys_and_an_unknown_one_is_one_line(capsys):
    assert main(["config", "regenerate"]) == 0
    out = capsys.readouterr().out
    listed = [x.split(" ", 1)[0] for x in out.splitlines() if not x.startswith(" ")]
    assert listed == [k.key for k in schema_keys() if k.key.startswith("regenerate.")]
    assert main(["config", "trian"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no config key under 'trian'" in err[0]
