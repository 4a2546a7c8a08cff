"""The air-gapped install's tooling (scripts/wheelhouse.py, scripts/airgap-install.sh) without a network: a
small wheel made here is trimmed like Ray's (paths dropped, RECORD rewritten, binaries stripped, exec bits
kept), installs with `pip install --no-index`, there is no budget unless one is given and then over it exits 2
with one line, the dependency walk stops at the image's packages, the image's own `pip list --format=freeze`
replaces the default list, and airgap-install.sh refuses with one line."""
from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "wheelhouse.py"
_spec = importlib.util.spec_from_file_location("wheelhouse", SCRIPT)
wh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wh)

DROP = ["demo/heavy/*", "demo/ui/*.map", "*/tests/*"]
# pip reads no machine config (find-links, extra indexes) and no index: what an air-gapped node sees
OFFLINE_ENV = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
OFFLINE_ENV.pop("PIP_FIND_LINKS", None)


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _binary(tmp_path: Path) -> bytes:
    """A runnable ELF file with a symbol table strip can remove (/bin/true plus one symbol), or /bin/true."""
    src = shutil.which("true") or "/bin/true"
    out = tmp_path / "tool"
    if shutil.which("objcopy"):
        subprocess.run(["objcopy", "--add-symbol", "demo_sym=.text:0,global", src, str(out)], check=True)
    else:
        shutil.copy(src, out)
    return out.read_bytes()


def make_wheel(tmp_path: Path) -> Path:
    """demo-1.0: a package, a tool with the executable bit, what the trim drops, a vendored dist-info with
    its own RECORD (as Ray's thirdparty_files have), two console scripts (one into a dropped module)."""
    files = {
        "demo/__init__.py": b"VALUE = 1\n",
        "demo/cli.py": b"def main():\n    print('demo')\n",
        "demo/heavy/__init__.py": b"def main():\n    pass\n",
        "demo/heavy/blob.bin": os.urandom(4096),
        "demo/ui/app.js": b"console.log(1)\n",
        "demo/ui/app.js.map": b"{}" * 2000,
        "demo/tests/test_demo.py": b"def test(): pass\n",
        "demo/thirdparty/x-1.0.dist-info/RECORD": b"x/__init__.py,,\n",
        "demo/core/tool": _binary(tmp_path),
        "demo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
        "demo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "demo-1.0.dist-info/entry_points.txt":
            b"[console_scripts]\ndemo = demo.cli:main\ndemo-heavy = demo.heavy:main\n",
    }
    path = tmp_path / "src" / "demo-1.0-py3-none-any.whl"
    path.parent.mkdir()
    record = io.StringIO()
    w = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            zi = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            zi.external_attr = (0o100755 if name == "demo/core/tool" else 0o100644) << 16
            z.writestr(zi, data)
            w.writerow((name, _hash(data), len(data)))
        w.writerow(("demo-1.0.dist-info/RECORD", "", ""))
        z.writestr("demo-1.0.dist-info/RECORD", record.getvalue())
    return path


def test_trimmed_wheel_drops_paths_keeps_a_valid_record_and_installs_offline(tmp_path):
    src = make_wheel(tmp_path)
    report = wh.trim_wheel(src, tmp_path / "out", drop=DROP)
    out = tmp_path / "out" / src.name
    assert out.exists() and report["bytes"] == out.stat().st_size
    assert report["dropped_files"] == 4 and set(report["dropped"]) == set(DROP)
    assert report["entry_points_dropped"] == ["demo-heavy"]

    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        assert not {n for n in names if n.startswith(("demo/heavy/", "demo/tests/")) or n.endswith(".map")}
        assert {"demo/ui/app.js", "demo/core/tool", "demo/thirdparty/x-1.0.dist-info/RECORD"} <= names
        rows = list(csv.reader(io.StringIO(z.read("demo-1.0.dist-info/RECORD").decode())))
        assert {r[0] for r in rows} == names          # RECORD lists exactly what the zip holds
        for name, digest, size in rows:
            if name == "demo-1.0.dist-info/RECORD":
                assert digest == size == ""
            else:
                data = z.read(name)
                assert digest == _hash(data) and int(size) == len(data), name
        assert (z.getinfo("demo/core/tool").external_attr >> 16) & 0o111
        assert "demo-heavy" not in z.read("demo-1.0.dist-info/entry_points.txt").decode()
    if shutil.which("strip") and shutil.which("objcopy"):   # binutils: the tool lost its symbol table
        (s,) = report["stripped"]
        assert s["path"] == "demo/core/tool" and s["after"] < s["before"]

    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(target), str(out)], capture_output=True, text=True, env=OFFLINE_ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    tool = target / "demo" / "core" / "tool"
    assert os.stat(tool).st_mode & stat.S_IXUSR                  # the exec bit survived pip
    assert subprocess.run([str(tool)]).returncode == 0           # and the stripped binary runs
    assert (target / "demo" / "ui" / "app.js").exists()
    assert not (target / "demo" / "heavy").exists() and not (target / "demo" / "tests").exists()
    assert not (target / "demo" / "ui" / "app.js.map").exists()
    r = subprocess.run([sys.executable, "-c", "import demo; print(demo.VALUE)"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(target)})
    assert r.stdout.strip() == "1", r.stderr


def test_manifest_lists_each_file_and_a_budget_given_exits_2_with_one_line(tmp_path):
    src = make_wheel(tmp_path)
    house = tmp_path / "house"
    wh.trim_wheel(src, house, drop=DROP)
    (house / "other-2.0-py3-none-any.whl").write_bytes(b"x" * 1000)

    r = subprocess.run([sys.executable, str(SCRIPT), "manifest", str(house), "--budget-mib", "0.001"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("airgap-wheelhouse: ") and "over the 0.001 MiB budget" in lines[0]

    r = subprocess.run([sys.executable, str(SCRIPT), "manifest", str(house)],   # the default: no budget
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "(no budget)" in r.stdout
    manifest = json.loads((house / "MANIFEST.json").read_text())
    assert {f["file"] for f in manifest["files"]} == {src.name, "other-2.0-py3-none-any.whl"}
    for f in manifest["files"]:
        p = house / f["file"]
        assert f["bytes"] == p.stat().st_size and f["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
    assert manifest["total_bytes"] == sum(p.stat().st_size for p in house.iterdir())


def _dist(name, *requires):
    return {"name": name, "version": "1.0", "file": f"{name}-1.0-py3-none-any.whl", "requires_dist": list(requires)}


def test_the_dependency_walk_follows_extras_and_markers_and_stops_at_the_image():
    resolved = [
        _dist("a", "b>=1", "c>=2.5", 'd; extra == "x"', 'g; extra == "y"'),
        _dist("b", 'old; python_version < "3.12"'),
        _dist("c", "zz"),                     # on the image: not walked into
        _dist("d", "venv-thing", 'e; python_version >= "3.12"'),
        _dist("e"), _dist("g"), _dist("old"), _dist("venv-thing"),
    ]
    carried, on_image = wh.closure(resolved, roots=["a[x]==1.0"], image=frozenset({"c"}), skip=("venv-thing",))
    assert sorted(r["name"] for r in carried) == ["a", "b", "d", "e"]
    assert on_image == {"c": [">=2.5"]}
    with pytest.raises(SystemExit, match="not in pip's resolution"):
        wh.closure([_dist("a", "missing")], roots=["a"], image=frozenset())


def test_the_image_list_comes_from_its_pip_freeze(tmp_path):
    freeze = tmp_path / "image-packages.txt"    # what `pip list --format=freeze` prints in the image, and more
    freeze.write_text("# from the image\nTorch==2.11.0+cu130\nnumpy==2.5.2\nPyArrow==17.0.0\n"
                      "transformers==5.17.0\nsafetensors==0.8.0\ntokenizers==0.23.2\ntqdm==4.67.1\n"
                      "matplotlib==3.10.0\nhuggingface_hub==1.0.0\nc==2.0\nlocal-pkg @ file:///wheels/local.whl\n"
                      "-e git+https://example.com/x.git#egg=x\n\n")
    versions = wh.read_image_packages(freeze)
    assert versions["torch"] == "2.11.0+cu130" and versions["pyarrow"] == "17.0.0"
    assert versions["huggingface-hub"] == "1.0.0" and versions["local-pkg"] is None and "x" not in versions

    # the image has no accelerate: the project's requirement goes into the wheelhouse's roots
    roots = wh.project_roots(frozenset(versions))
    assert roots[:len(wh.ROOTS)] == wh.ROOTS and roots[len(wh.ROOTS):] == ["accelerate>=1.1"]
    assert wh.project_roots(wh.CUDA_TORCH_IMAGE_PACKAGES) == wh.ROOTS   # the default image has them all
    with pytest.raises(SystemExit, match="the image has no torch"):
        wh.project_roots(frozenset(versions) - {"torch"})

    # the walk stops at the image's packages, and the build names those too old for what is carried
    resolved = [_dist("a", "b>=1", "c>=2.5", "pyarrow>=14"), _dist("b"), _dist("c"), _dist("pyarrow")]
    carried, on_image = wh.closure(resolved, roots=["a"], image=frozenset(versions))
    assert [r["name"] for r in carried] == ["a", "b"] and on_image == {"c": [">=2.5"], "pyarrow": [">=14"]}
    assert wh.too_old_on_image(on_image, versions) == ["c 2.0 (wants >=2.5)"]

    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(SystemExit, match="names no package"):
        wh.read_image_packages(tmp_path / "empty.txt")


def _airgap_install(wheelhouse, **env):
    return subprocess.run(["bash", str(REPO / "scripts" / "airgap-install.sh"), str(wheelhouse)],
                          capture_output=True, text=True, env={**OFFLINE_ENV, "PYTHON": sys.executable, **env})


def test_airgap_install_refuses_with_one_line(tmp_path):
    r = _airgap_install(tmp_path / "nowhere")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("airgap-install: no wheelhouse at")

    house = tmp_path / "house"
    house.mkdir()   # the image's pip is too old for what a package in the wheelhouse asks, and one is not there
    (house / "MANIFEST.json").write_text(json.dumps({"on_image_not_carried": {
        "pip": [">=999"], "surely-not-installed-pkg": ["*"]}}))
    r = _airgap_install(house)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "pip " in lines[0] and "wants >=999" in lines[0] and "surely-not-installed-pkg (missing)" in lines[0]
    assert "WHEELHOUSE_ALSO=pip,surely-not-installed-pkg" in lines[0]
