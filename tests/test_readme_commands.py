"""The README's commands stay runnable: every `dflash-ray ...` it writes (inline and in its bash blocks) names
a command the CLI has, and every override in it is a key of the typed config (or a group option that exists
as a preset file), so a renamed key or a dropped preset fails here rather than in a user's shell. Values are
placeholders in the README (DIR, FILE, N), so they are not composed; the keys and options are."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from omegaconf import OmegaConf

from dflash_ray.cli import COMMANDS
from dflash_ray.config import CONF_DIR, compose_config

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
GROUPS = ("model", "data", "cluster", "train")
# arguments that are a command's own, not config keys (the README says so beside them)
OWN = {"push": {"export"}, "compare": {"KEY"}}
_MISSING = object()


def readme_commands() -> list[str]:
    inline = re.findall(r"`(dflash-ray [^`]+)`", README)
    blocks = [line.strip() for block in re.findall(r"```bash\n(.*?)```", README, re.S)
              for line in block.replace("\\\n", " ").splitlines()]
    # a block's `.venv/bin/dflash-ray ...` is the same command
    blocks = [re.sub(r"^\S*/dflash-ray ", "dflash-ray ", b) for b in blocks]
    return inline + [b.split("#")[0].strip() for b in blocks if b.startswith("dflash-ray ")]


def overrides(words: list[str]) -> list[tuple[str, str]]:
    out = []
    for w in words:
        w = w.strip("[]")
        if "=" not in w or w.startswith("-") or w.startswith("<"):
            continue
        key, value = w.split("=", 1)
        out.append((key.lstrip("+~"), value))
    return out


def test_the_readme_writes_commands():
    cmds = readme_commands()
    assert len(cmds) >= 6 and any(c.startswith("dflash-ray eval ") for c in cmds)


def test_every_readme_command_is_a_command_and_its_keys_exist():
    base = compose_config([])
    bad = []
    for line in readme_commands():
        words = shlex.split(line.replace("\\|", "|"))
        cmd = words[1]
        if cmd.startswith("-") or cmd.startswith("<"):
            continue
        if cmd not in COMMANDS:
            bad.append(f"{line}: no command {cmd!r}")
            continue
        for key, value in overrides(words[2:]):
            if key in OWN.get(cmd, ()):
                continue
            if key in GROUPS:
                for option in value.split("|"):
                    if not (CONF_DIR / key / f"{option}.yaml").is_file() and option not in ("...",):
                        bad.append(f"{line}: no preset {key}={option}")
            elif OmegaConf.select(base, key, default=_MISSING, throw_on_missing=False) is _MISSING \
                    and not key.startswith("data.chat_template_kwargs"):
                bad.append(f"{line}: no config key {key!r}")
    assert bad == []


def test_the_check_finds_a_stale_key():
    base = compose_config([])
    assert OmegaConf.select(base, "train.checkpoint_layers", default=_MISSING) is _MISSING   # renamed long ago
    assert overrides(["[eval.max_new_tokens=N]", "--json", "model=tiny"]) == [("eval.max_new_tokens", "N"), ("model", "tiny")]
