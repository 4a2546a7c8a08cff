"""Every line of the README's bash blocks runs as written, in the form that is cheap here: a `dflash-ray`
command composes its whole config with the line's own values (`--cfg job`: a renamed key, a dropped preset or
a bad value fails here, not in a user's shell); a `jobs/*.sh` line composes the main job's config with the
presets the script submits and the line's arguments; a script or file a line names exists (scripts
executable); shell variables the block sets are expanded as the shell would. Lines of other programs
(sglang, kubectl, ray up) have their files checked. A line this test does not know fails it, so a new kind of
command gets a check when it is written."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from dflash_ray.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def blocks() -> list[list[str]]:
    """Each bash block's logical lines (continuations joined, comments and blank lines dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        lines = [shlex.split(x, comments=True) for x in block.replace("\\\n", " ").splitlines()]
        out.append([w for w in lines if w])
    return out


def expanded(words: list[str], env: dict) -> list[str]:
    return [env.get(w[1:], w) if w.startswith("$") else w for w in words]


def script_presets(script: Path) -> list[str]:
    """The overrides a jobs/ script submits before "$@" (RUN_ROOT and RUN_NAME at their defaults)."""
    text = script.read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if "python -m dflash_ray.train" in x)
    words = shlex.split(line.split("python -m dflash_ray.train", 1)[1].replace('"$@"', ""))
    return [re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", w).replace("$PWD", str(ROOT)) for w in words]


def lines() -> list[tuple[dict, list[str]]]:
    out = []
    for block in blocks():
        env = {}
        for words in block:
            if len(words) == 1 and re.match(r"^[A-Za-z_]\w*=", words[0]):
                name, value = words[0].split("=", 1)
                env[name] = value
                continue
            lead = []
            while words and re.match(r"^[A-Z_]+=", words[0]):   # VAR=value command ...
                lead.append(words.pop(0))
            out.append((dict(env), expanded(words, env)))
    return out


def test_the_readme_has_its_blocks():
    found = lines()
    assert len(found) >= 15
    programs = {Path(w[0]).name for _, w in found}
    assert {"dflash-ray", "8gpu.sh", "run-default.sh", "run-tests.sh"} <= programs, programs


@pytest.mark.parametrize("words", [w for _, w in lines()], ids=lambda w: " ".join(w)[:60])
def test_each_line_runs_as_written(words, capsys):
    program = words[0]
    name = Path(program).name
    if name == "dflash-ray":
        cmd, args = words[1], words[2:]
        assert main([cmd, "--cfg", "job", *args]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.strip()
    elif program.startswith(("jobs/", "scripts/", "./scripts/")):
        script = ROOT / program.lstrip("./")
        assert script.is_file() and script.stat().st_mode & 0o111, program
        if program.startswith("jobs/"):
            assert main(["train", "--cfg", "job", *script_presets(script), *words[1:]]) == 0, capsys.readouterr().err
    elif name in ("kubectl", "ray"):
        for w in words[1:]:
            if "/" in w and not w.startswith("-"):
                assert (ROOT / w).is_file(), w
    elif program == "python" and words[1:3] == ["-m", "sglang.launch_server"]:
        assert "--speculative-algorithm" in words and "DFLASH" in words
    else:
        pytest.fail(f"a README line this test does not check: {' '.join(words)}")
