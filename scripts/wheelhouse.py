#!/usr/bin/env python3
"""A wheelhouse for an air-gapped GPU cluster: Ray and the Python packages its image lacks, as cp312 manylinux
x86_64 wheels, built on a machine with PyPI and installed on the cluster with `pip install --no-index`. The image
is one that already has CUDA torch; the packages it has are not put in the wheelhouse (the default list is a
CUDA torch image's: torch, transformers, pyarrow, ...; --image-packages reads the image's own). The Ray wheel is
trimmed (no Java workers, RLlib, Serve, LLM, dashboard source maps; binaries stripped).

scripts/airgap-wheelhouse.sh calls `build`; scripts/airgap-install.sh installs the result on the cluster;
tests/test_airgap_wheelhouse.py calls trim_wheel/write_manifest/closure on wheels it makes. docs/air-gapped.md
is the guide.

    python scripts/wheelhouse.py build --out .wheelhouse [--cache DIR] [--image-packages FREEZE.txt] [--budget-mib N]
    python scripts/wheelhouse.py trim SRC.whl OUTDIR [--drop GLOB ...] [--no-strip]
    python scripts/wheelhouse.py manifest OUTDIR [--budget-mib N]

FREEZE.txt: `pip list --format=freeze` run in the image (one `name==version` a line). --budget-mib: the most the
folder may hold, 0 (the default) for no budget; over it, exit status 2 with one line on stderr.
"""
from __future__ import annotations

import argparse
import base64
import csv
import fnmatch
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024

# What the wheelhouse carries: the project's requirements that a CUDA torch image lacks. torch, transformers,
# accelerate, safetensors, tokenizers, tqdm, matplotlib, numpy and pyarrow come from the image.
ROOTS = [
    "ray[default,train]==2.60.0",
    "hydra-core>=1.3.2,<1.4",
    "omegaconf>=2.3,<2.4",
    "antlr4-python3-runtime==4.9.3",   # hydra/omegaconf need 4.9.*; PyPI has it only as an sdist: built here
]
SDIST_ONLY = ["antlr4-python3-runtime==4.9.3"]   # pure Python: `pip wheel` makes a py3-none-any wheel
# The image's CUDA build of torch is what the cluster runs: the wheelhouse never carries torch
FROM_THE_IMAGE_ONLY = ("torch",)

# The target: the image's Python 3.12 on x86_64 Linux (glibc >= 2.28: manylinux_2_28 wheels install)
PYTHON_VERSION = "3.12"
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux1_x86_64", "manylinux2010_x86_64", "linux_x86_64"]

# The default image's Python packages: a CUDA torch image (torch, transformers, pyarrow, pandas, jax, ...; Python
# 3.12). Not put in the wheelhouse. --image-packages replaces this list with the image's own `pip list
# --format=freeze`, whose versions the build then checks; with this list the versions are unknown until
# scripts/airgap-install.sh reads them on the cluster and names one that is too old.
CUDA_TORCH_IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning
pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers
toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash
yarl zipp
""".split())

# Left out although ray[default] asks for it: virtualenv (5.5 MiB with its seed wheels, plus distlib,
# python-discovery, platformdirs) serves runtime_env's pip/uv, which needs a package index an air-gapped cluster
# has not
SKIP = ("virtualenv",)

# What the Ray wheel loses (fnmatch globs over the wheel's paths; `*` crosses folders). Kept: Ray Core,
# Data, Train, Tune (Train's v1 API and its result types use it), AIR, the autoscaler, the dashboard's Python
# (`ray job submit` needs its job server) and its web client less source maps, the runtime-env agent.
RAY_DROP = [
    "ray/jars/*",                               # Java workers' jar (32 MB compressed)
    "ray/rllib/*",                              # RLlib
    "ray/serve/*",                              # Ray Serve
    "ray/llm/*",                                # Ray LLM (vLLM serving/batch)
    "ray/dashboard/client/build/*.map",         # the web client's source maps
    "*/tests/*",                                # test folders, where a wheel has them
]


TRIM_VERSION = 1   # bump when trim_wheel's output changes: the trimmed Ray in the cache is rebuilt


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dist_name(wheel: str | Path) -> str:
    """The normalized project name of a wheel file (PEP 427 file name)."""
    return normalize(Path(wheel).name.split("-")[0])


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _strip(data: bytes, strip_cmd: str) -> bytes | None:
    """`strip --strip-unneeded` on a copy of an ELF file: symbols and debug sections go, the dynamic symbol
    table (what the loader and Python's extension import use) stays. None when strip fails."""
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "elf"
        p.write_bytes(data)
        r = subprocess.run([strip_cmd, "--strip-unneeded", str(p)], capture_output=True)
        if r.returncode != 0:
            return None
        return p.read_bytes()


def _module_file_dropped(module: str, kept: set[str], dropped: set[str]) -> bool:
    base = module.replace(".", "/")
    for cand in (base + ".py", base + "/__init__.py"):
        if cand in kept:
            return False
        if cand in dropped:
            return True
    return False


def trim_wheel(src: str | Path, out_dir: str | Path, drop=RAY_DROP, strip: bool = True,
               strip_cmd: str = "strip", compresslevel: int = 9) -> dict:
    """Repack `src` into out_dir under the same file name without the files that match `drop`, with ELF
    files stripped; RECORD is rewritten for what is left (new hashes and sizes), the zip modes (executable
    bits) are kept, console scripts whose module went are removed from entry_points.txt. Returns a report."""
    src, out_dir = Path(src), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / src.name
    if dst.resolve() == src.resolve():
        raise ValueError(f"trim_wheel: {src} would overwrite itself")
    if strip and shutil.which(strip_cmd) is None:
        print(f"wheelhouse: no `{strip_cmd}` on PATH: binaries left unstripped", file=sys.stderr)
        strip = False
    report = {"wheel": src.name, "source_bytes": src.stat().st_size, "dropped": {p: {"files": 0, "bytes": 0}
              for p in drop}, "stripped": [], "entry_points_dropped": []}
    with zipfile.ZipFile(src) as zin:
        infos = [i for i in zin.infolist() if not i.is_dir()]
        records = [i.filename for i in infos   # the wheel's own (vendored packages may carry theirs deeper)
                   if i.filename.endswith(".dist-info/RECORD") and i.filename.count("/") == 1]
        if len(records) != 1:
            raise ValueError(f"trim_wheel: {src.name} has {len(records)} dist-info RECORD files")
        record_path = records[0]
        dist_info = record_path.rsplit("/", 1)[0]
        names = [i.filename for i in infos if i.filename != record_path]
        dropped = set()
        for name in names:
            if name.startswith(dist_info + "/"):
                continue
            for pat in drop:
                if fnmatch.fnmatchcase(name, pat):
                    dropped.add(name)
                    size = zin.getinfo(name).file_size
                    report["dropped"][pat]["files"] += 1
                    report["dropped"][pat]["bytes"] += size
                    break
        kept_names = set(names) - dropped
        tmp = dst.with_name(dst.name + ".part")
        rows = []
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=compresslevel) as zout:
            for info in infos:
                name = info.filename
                if name == record_path or name in dropped:
                    continue
                data = zin.read(info)
                if strip and data[:4] == b"\x7fELF":
                    small = _strip(data, strip_cmd)
                    if small is not None and len(small) < len(data):
                        report["stripped"].append({"path": name, "before": len(data), "after": len(small)})
                        data = small
                if name == f"{dist_info}/entry_points.txt":
                    data = _trim_entry_points(data, kept_names, dropped, report["entry_points_dropped"])
                zi = zipfile.ZipInfo(name, date_time=info.date_time)
                zi.external_attr = info.external_attr   # the mode bits: gcs_server and raylet stay executable
                zi.create_system = info.create_system
                zi.compress_type = zipfile.ZIP_DEFLATED
                zout.writestr(zi, data, compresslevel=compresslevel)
                rows.append((name, _record_hash(data), str(len(data))))
            buf = io.StringIO()
            w = csv.writer(buf, lineterminator="\n")
            w.writerows(rows)
            w.writerow((record_path, "", ""))
            ri = zipfile.ZipInfo(record_path, date_time=zin.getinfo(record_path).date_time)
            ri.external_attr = zin.getinfo(record_path).external_attr
            ri.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(ri, buf.getvalue().encode(), compresslevel=compresslevel)
        os.replace(tmp, dst)
    report["bytes"] = dst.stat().st_size
    report["dropped_files"] = len(dropped)
    report["dropped"] = {p: v for p, v in report["dropped"].items() if v["files"]}
    return report


def _trim_entry_points(data: bytes, kept: set[str], dropped: set[str], gone: list) -> bytes:
    out = []
    for line in data.decode().splitlines():
        m = re.match(r"\s*([^=\s]+)\s*=\s*([\w.]+)\s*:", line)
        if m and _module_file_dropped(m.group(2), kept, dropped):
            gone.append(m.group(1))
            continue
        out.append(line)
    return ("\n".join(out) + "\n").encode()


def write_manifest(out_dir: str | Path, budget_mib: float, extra: dict | None = None) -> dict:
    """MANIFEST.json in out_dir: each wheel's name, size and sha256, the total (the manifest itself
    included) and the budget (0: none), plus `extra` (what was trimmed, what the image already has)."""
    out_dir = Path(out_dir)
    files = [{"file": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(out_dir.iterdir()) if p.is_file() and p.name != "MANIFEST.json"]
    manifest = {"python": PYTHON_VERSION, "files": files, "budget_mib": budget_mib, **(extra or {})}
    path = out_dir / "MANIFEST.json"
    total = sum(f["bytes"] for f in files)
    for _ in range(3):   # the total counts the manifest, whose size depends on the total's digits
        manifest["total_bytes"] = total + (path.stat().st_size if path.exists() else 0)
        path.write_text(json.dumps(manifest, indent=1) + "\n")
    manifest["total_bytes"] = total + path.stat().st_size
    return manifest


def check_budget(manifest: dict, out_dir) -> int:
    """Prints the table; 2 with one line on stderr when over the budget (a budget of 0 or less: none)."""
    for f in sorted(manifest["files"], key=lambda f: -f["bytes"]):
        print(f"  {f['bytes'] / MIB:7.2f} MiB  {f['file']}")
    total = manifest["total_bytes"] / MIB
    budget = manifest["budget_mib"] or 0
    print(f"wheelhouse: {out_dir}: {len(manifest['files'])} files, {total:.2f} MiB "
          + (f"(budget {budget} MiB)" if budget > 0 else "(no budget)"))
    if budget > 0 and total > budget:
        print(f"airgap-wheelhouse: {out_dir} is {total:.2f} MiB, over the {budget} MiB budget "
              f"(WHEELHOUSE_BUDGET_MIB)", file=sys.stderr)
        return 2
    return 0


# --- the build: resolve, download, trim, copy, manifest ---------------------------------------------------

def _pip(py: str, *args: str) -> list[str]:
    return [py, "-m", "pip", *args]


def _target_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp",
            "--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args


def _run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        raise SystemExit(f"airgap-wheelhouse: {what} failed (exit {r.returncode})")
    return r


def _packaging():
    try:
        from packaging.requirements import Requirement
    except ImportError:   # pip vendors it
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


# The marker environment of the image's Python (pip evaluates markers with the resolving interpreter's)
TARGET_ENV = {"python_version": PYTHON_VERSION, "python_full_version": PYTHON_VERSION + ".3", "os_name": "posix",
              "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
              "implementation_name": "cpython", "platform_python_implementation": "CPython",
              "implementation_version": PYTHON_VERSION + ".3"}


def project_roots(image: frozenset, pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """ROOTS plus the project's own requirements (pyproject.toml's dependencies) that `image` lacks: an image
    without, say, accelerate gets it from the wheelhouse. Torch must be in the image: one line and exit 2."""
    import tomllib

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    Requirement = _packaging()
    have = {normalize(Requirement(r).name) for r in ROOTS}
    roots = list(ROOTS)
    for dep in deps:
        name = normalize(Requirement(dep).name)
        if name in FROM_THE_IMAGE_ONLY and name not in image:
            raise SystemExit(f"airgap-wheelhouse: the image has no {name}: the wheelhouse is for an image with "
                             f"CUDA torch (its list of packages names no {name})")
        if name not in image and name not in have:
            roots.append(dep)
    return roots


def resolve(py: str, cache: Path, roots=ROOTS) -> list[dict]:
    """What pip installs for `roots` on Python 3.12, manylinux x86_64: the report of a dry run (no install,
    metadata only), one {name, version, file, requires_dist} per package, the image's ones too."""
    report = cache / "resolve-report.json"
    with tempfile.TemporaryDirectory() as target:   # --target: older pips take the platform options only so
        _run(_pip(py, "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
                  "--target", target, "--find-links", str(cache), *_target_args(), *roots),
             "resolving (pip install --dry-run)")
    data = json.loads(report.read_text())
    ver = data.get("environment", {}).get("python_version")
    if ver != PYTHON_VERSION:
        print(f"wheelhouse: resolved with Python {ver}, not {PYTHON_VERSION}: pip evaluated the requirements' "
              f"markers for {ver} (RESOLVE_PYTHON=<a python{PYTHON_VERSION}> resolves as the image's Python would)",
              file=sys.stderr)
    return [{"name": normalize(i["metadata"]["name"]), "version": i["metadata"]["version"],
             "file": unquote(i["download_info"]["url"].rsplit("/", 1)[-1].split("#")[0]),
             "requires_dist": i["metadata"].get("requires_dist") or []} for i in data["install"]]


def read_image_packages(path: str | Path) -> dict[str, str | None]:
    """{normalized name: version} from `pip list --format=freeze` (or `pip freeze`) output run in the image:
    `name==version` lines; `name @ URL` lines count with no version; blank lines, comments and options
    (`-e ...`, `--...`) are skipped. A file that names no package stops the build with one line."""
    found: dict[str, str | None] = {}
    for raw in Path(path).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*(?:(===?)\s*([^\s;]+)|@\s*\S+)?", line)
        if not m:
            raise SystemExit(f"airgap-wheelhouse: {path}: not a package line: {raw.strip()!r}")
        found[normalize(m.group(1))] = m.group(3)
    if not found:
        raise SystemExit(f"airgap-wheelhouse: {path} names no package (expected `pip list --format=freeze` output)")
    return found


def too_old_on_image(on_image: dict[str, list[str]], versions: dict[str, str | None]) -> list[str]:
    """The image packages whose known version does not satisfy what the carried packages ask of them, as
    'name version (wants SPEC)'. Unknown versions (a `name @ URL` line) are not judged here."""
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:   # pip vendors it
        from pip._vendor.packaging.specifiers import SpecifierSet
    bad = []
    for name, specs in on_image.items():
        have = versions.get(name)
        want = SpecifierSet(",".join(s for s in specs if s != "*"))
        try:
            fits = have is None or want.contains(have, prereleases=True)
        except Exception:   # a version string that is not PEP 440: not judged
            fits = True
        if not fits:
            bad.append(f"{name} {have} (wants {want})")
    return bad


def closure(resolved: list[dict], roots=ROOTS, image=CUDA_TORCH_IMAGE_PACKAGES, skip=()) -> tuple[list, dict]:
    """What the cluster needs from `resolved`: the roots and their requirements (markers evaluated for the
    image's Python, extras followed), not descending into the image's packages or `skip`. Returns the
    entries the wheelhouse carries and {image package: [the specifiers asked of it]}."""
    Requirement = _packaging()
    by_name = {r["name"]: r for r in resolved}
    carried, on_image, seen = {}, {}, set()
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = normalize(req.name)
        if name in image:
            on_image.setdefault(name, set()).add(str(req.specifier) or "*")
            continue
        if name in skip:
            continue
        for extra in sorted(req.extras) + [""]:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            entry = by_name.get(name)
            if entry is None:
                raise SystemExit(f"airgap-wheelhouse: {name} is needed but not in pip's resolution")
            carried[name] = entry
            for rd in entry["requires_dist"]:
                sub = Requirement(rd)
                if sub.marker is None or sub.marker.evaluate({**TARGET_ENV, "extra": extra}):
                    todo.append(sub)
    return list(carried.values()), {k: sorted(v) for k, v in sorted(on_image.items())}


def build(out: Path, cache: Path, budget_mib: float, py: str, skip=SKIP, also=(), image_packages=None) -> int:
    """Resolve, download (into `cache`, reused), trim Ray, copy into `out`, write the manifest; 2 when over
    the budget (0: none). `also`: image packages to put in the wheelhouse all the same (one too old in the
    image). `image_packages`: a `pip list --format=freeze` file from the image (default: a CUDA torch image's
    list, CUDA_TORCH_IMAGE_PACKAGES). No wheel of the project: scripts/airgap-install.sh installs the copied
    source tree editable (the source on the cluster is what runs)."""
    t0 = time.time()
    cache.mkdir(parents=True, exist_ok=True)
    for spec in SDIST_ONLY:
        name, version = spec.split("==")
        stem = f"{name.replace('-', '_')}-{version}-"
        if not any(p.name.startswith(stem) and p.suffix == ".whl" for p in cache.iterdir()):
            print(f"wheelhouse: building {spec} (an sdist on PyPI) into {cache}")
            _run(_pip(py, "wheel", "--no-deps", "--quiet", "-w", str(cache), spec), f"pip wheel {spec}")
    versions = read_image_packages(image_packages) if image_packages else {}
    image = (frozenset(versions) if image_packages else CUDA_TORCH_IMAGE_PACKAGES) - set(also)
    roots = project_roots(image)
    resolved = resolve(py, cache, roots)
    carried, on_image = closure(resolved, roots=roots, image=image, skip=skip)
    missing = [r for r in carried if not (cache / r["file"]).exists()]
    if missing:
        print(f"wheelhouse: downloading {len(missing)} wheels into {cache}")
        _run(_pip(py, "download", "--no-deps", "--quiet", "-d", str(cache), "--find-links", str(cache),
                  *_target_args(), *[f"{r['name']}=={r['version']}" for r in missing]), "pip download")
    for r in carried:
        if not (cache / r["file"]).exists():
            raise SystemExit(f"airgap-wheelhouse: {r['file']} is not in {cache} after the download")

    out.mkdir(parents=True, exist_ok=True)
    want = set()
    trims = []
    for r in carried:
        src = cache / r["file"]
        if r["name"] == "ray":
            key = hashlib.sha256(json.dumps([src.name, src.stat().st_size, RAY_DROP, TRIM_VERSION]
                                            ).encode()).hexdigest()[:16]
            tdir = cache / "trimmed" / key
            done = tdir / (src.name + ".json")
            if not done.exists():
                print(f"wheelhouse: trimming {src.name} ({src.stat().st_size / MIB:.1f} MiB) ...")
                rep = trim_wheel(src, tdir)
                done.write_text(json.dumps(rep, indent=1))
            rep = json.loads(done.read_text())
            trims.append(rep)
            src = tdir / src.name
        dst = out / src.name
        if not dst.exists() or dst.stat().st_size != src.stat().st_size or sha256_file(dst) != sha256_file(src):
            shutil.copy2(src, dst)
        want.add(dst.name)

    for p in out.iterdir():   # what an earlier build left that this one does not carry
        if p.is_file() and p.name not in want and p.name != "MANIFEST.json":
            p.unlink()

    extra = {"roots": roots, "carried": sorted(f"{r['name']}=={r['version']}" for r in carried),
             "skipped": sorted(skip), "also": sorted(also), "on_image_not_carried": on_image,
             "image_packages": str(image_packages) if image_packages else "a CUDA torch image (the default list)",
             "ray_trim": trims,
             "built_with": f"{Path(__file__).name} in {time.time() - t0:.1f} s"}
    manifest = write_manifest(out, budget_mib, extra)
    for t in trims:
        print(f"wheelhouse: {t['wheel']}: {t['source_bytes'] / MIB:.1f} MiB -> {t['bytes'] / MIB:.1f} MiB "
              f"({t['dropped_files']} files dropped, {len(t['stripped'])} binaries stripped)")
    asked = ", ".join(k + ",".join(s for s in v if s != "*") for k, v in on_image.items())
    print(f"wheelhouse: not carried, in the image: {asked}")
    print(f"wheelhouse: left out: {', '.join(sorted(skip)) or 'nothing'}")
    old = too_old_on_image(on_image, versions)
    if old:
        print(f"wheelhouse: warning: the image's packages do not fit what the wheelhouse asks: {'; '.join(old)} "
              f"-- rebuild with WHEELHOUSE_ALSO={','.join(b.split()[0] for b in old)} to carry them",
              file=sys.stderr)
    return check_budget(manifest, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", default=str(REPO / ".wheelhouse"))
    b.add_argument("--cache", default=os.path.expanduser("~/.cache/dflash-ray/wheels"))
    b.add_argument("--budget-mib", type=float, default=0,
                   help="the most the folder may hold, in MiB (default 0: no budget); over it, exit 2")
    b.add_argument("--python", default=sys.executable,
                   help="the Python whose pip resolves (a 3.12 one evaluates markers as the image's does)")
    b.add_argument("--image-packages", default="", metavar="FREEZE.txt",
                   help="`pip list --format=freeze` output from the image: the packages it has (default: a CUDA "
                        "torch image's list)")
    b.add_argument("--skip", default=",".join(SKIP), help="packages not to carry, comma-separated")
    b.add_argument("--also", default="", help="image packages to carry all the same, comma-separated")
    t = sub.add_parser("trim")
    t.add_argument("src")
    t.add_argument("out_dir")
    t.add_argument("--drop", action="append", help="a glob to drop (repeatable; default: Ray's list)")
    t.add_argument("--no-strip", action="store_true")
    m = sub.add_parser("manifest")
    m.add_argument("out_dir")
    m.add_argument("--budget-mib", type=float, default=0, help="in MiB; 0 (the default): no budget")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        return build(Path(a.out), Path(a.cache), a.budget_mib, a.python,
                     tuple(normalize(x) for x in a.skip.split(",") if x.strip()),
                     tuple(normalize(x) for x in a.also.split(",") if x.strip()),
                     image_packages=a.image_packages or None)
    if a.cmd == "trim":
        rep = trim_wheel(a.src, a.out_dir, drop=a.drop or RAY_DROP, strip=not a.no_strip)
        print(json.dumps(rep, indent=1))
        return 0
    manifest = write_manifest(a.out_dir, a.budget_mib)
    return check_budget(manifest, a.out_dir)


if __name__ == "__main__":
    sys.exit(main())
