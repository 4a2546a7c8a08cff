"""How Ray users launch (deploy/): the cluster image, the KubeRay RayJob and the `ray up` config, each
checked against the schema its tool validates with, and the image's install script run here.

- The RayJob against the RayJob CRD's OpenAPI v3 schema (deploy/kuberay/ray.io_rayjobs.schema.json, from
  KubeRay v1.7.0), also with unknown fields refused as `kubectl apply` (strict field validation) refuses
  them; its entrypoint's overrides composed by the project's own config; its GPUs equal to what the config
  places.
- The `ray up` YAML with Ray's own autoscaler schema and checks (`prepare_config` + `validate_config`, what
  `ray up` runs before it talks to the cloud).
- The Dockerfile's base image against the pins (pyproject's Ray, torch's CUDA index, this Python), and its
  install script run here into a throwaway environment layered on .venv (no index, CPU torch).
"""
from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from dflash_ray.config import compose_config
from dflash_ray.errors import UserError

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
CRD_SCHEMA = DEPLOY / "kuberay" / "ray.io_rayjobs.schema.json"
SHARED = "/mnt/shared"


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def strict(schema):
    """The schema with unknown fields refused wherever it names its fields (what the API server's strict
    field validation does; a structural CRD schema alone would let a misspelt field through, pruned)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def crd_validators():
    schema = json.loads(CRD_SCHEMA.read_text())
    # OpenAPI v3.0 schemas are JSON Schema draft 4 (plus keywords a validator ignores: nullable, x-kubernetes-*)
    return jsonschema.Draft4Validator(schema), jsonschema.Draft4Validator(strict(schema))


def rayjob_errors(validators, manifest) -> list[str]:
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                  for v in validators for e in v.iter_errors(manifest))


def cluster_gpus(cfg) -> float:
    c = cfg.cluster
    return c.target_workers * c.target_gpus + c.drafter_workers * c.drafter_gpus


# ----------------------------------------------------------------------------- KubeRay RayJob
def test_the_crd_schema_is_the_rayjob_one_and_names_its_source(crd_validators):
    schema = crd_validators[0].schema
    source = schema["$comment"]
    assert "KubeRay v1.7.0" in source and "ray-operator/config/crd/bases/ray.io_rayjobs.yaml" in source
    commit = re.search(r"commit ([0-9a-f]{40})", source).group(1)
    assert commit in (DEPLOY / "kuberay" / "README.md").read_text()
    worker = schema["properties"]["spec"]["properties"]["rayClusterSpec"]["properties"]["workerGroupSpecs"]["items"]
    assert {"groupName", "template"} <= set(worker["required"])


def test_rayjob_validates_against_the_crd_schema(crd_validators):
    manifest = load_yaml(DEPLOY / "kuberay" / "rayjob.yaml")
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayJob")
    assert rayjob_errors(crd_validators, manifest) == []


def _drop_group_name(m):
    del m["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["groupName"]


def _replicas_as_words(m):
    m["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "one"


def _misspelt_field(m):
    group = m["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["rayStartParms"] = group.pop("rayStartParams")


def _entrypoint_as_list(m):
    m["spec"]["entrypoint"] = m["spec"]["entrypoint"].split()


def _no_head_group(m):
    del m["spec"]["rayClusterSpec"]["headGroupSpec"]


@pytest.mark.parametrize("breakage, where", [
    (_drop_group_name, "'groupName' is a required property"),
    (_replicas_as_words, "spec.rayClusterSpec.workerGroupSpecs.0.replicas: 'one' is not of type 'integer'"),
    (_misspelt_field, "'rayStartParms' was unexpected"),
    (_entrypoint_as_list, "spec.entrypoint: "),
    (_no_head_group, "'headGroupSpec' is a required property"),
])
def test_a_broken_rayjob_fails_validation(crd_validators, breakage, where):
    manifest = load_yaml(DEPLOY / "kuberay" / "rayjob.yaml")
    breakage(manifest)
    errors = rayjob_errors(crd_validators, manifest)
    assert any(where in e for e in errors), errors


def test_rayjob_entrypoint_composes_and_its_gpus_are_the_configs():
    manifest = load_yaml(DEPLOY / "kuberay" / "rayjob.yaml")
    spec = manifest["spec"]
    words = shlex.split(spec["entrypoint"])
    assert words[:3] == ["python", "-m", "dflash_ray.train"]
    overrides = words[3:]
    assert overrides and all("=" in w for w in overrides)
    cfg = compose_config(overrides)  # an unknown key or a wrong type raises UserError naming it
    assert cfg.cluster.use_gpu and cfg.model.name == "qwen3_8b"
    # everything the run keeps lives on the shared volume
    for key in ("run.root", "data.shards", "train.storage_path"):
        assert str(cfg_value(cfg, key)).startswith(SHARED + "/"), key
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    assert env["HF_HOME"].startswith(SHARED + "/")
    # KubeRay's retries (each on a new RayCluster) resume the run: a fixed run.name on the shared volume
    assert spec["backoffLimit"] >= 1 and "run.name" in {w.split("=")[0] for w in overrides}
    # the GPU worker group has exactly the GPUs the composed config places (6 target + 2 drafter for 8gpu)
    cluster = spec["rayClusterSpec"]
    (group,) = cluster["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"]) * group["replicas"]
    assert gpus == cluster_gpus(cfg) == 8
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"  # the head runs the driver only
    assert cluster["rayVersion"] == image_ray()


def cfg_value(cfg, key):
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key)


def test_a_misspelt_entrypoint_override_is_refused():
    words = shlex.split(load_yaml(DEPLOY / "kuberay" / "rayjob.yaml")["spec"]["entrypoint"])[3:]
    words = [w.replace("train.storage_path=", "train.storage=") for w in words]
    with pytest.raises(UserError, match="train.storage"):
        compose_config(words)


def test_every_pod_mounts_the_shared_claim_and_runs_the_image():
    manifest = load_yaml(DEPLOY / "kuberay" / "rayjob.yaml")
    pvc = load_yaml(DEPLOY / "kuberay" / "pvc.yaml")
    assert pvc["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in pvc["spec"]["accessModes"]
    cluster = manifest["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    images = set()
    for pod in pods:
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in pod["volumes"] if "persistentVolumeClaim" in v}
        for container in pod["containers"]:
            images.add(container["image"])
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            shared = [name for name, path in mounts.items() if path == SHARED]
            assert len(shared) == 1 and claims.get(shared[0]) == pvc["metadata"]["name"]
    ray_up = load_yaml(DEPLOY / "ray-up.yaml")
    assert images == {ray_up["docker"]["image"]}
    # the tag the Dockerfile's header builds
    assert f"-t {ray_up['docker']['image']} " in (DEPLOY / "Dockerfile").read_text()


# ----------------------------------------------------------------------------- ray up
def ray_schema() -> dict:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def ray_up_check(config: dict) -> None:
    """What `ray up` checks before it reaches the cloud: the raw file against the schema, then Ray's own
    prepare_config (defaults of the provider merged) and validate_config (the schema again and its rules)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    jsonschema.validate(config, ray_schema())
    validate_config(prepare_config(copy.deepcopy(config)))


def test_ray_up_validates_with_rays_own_schema():
    config = load_yaml(DEPLOY / "ray-up.yaml")
    ray_up_check(config)
    types = config["available_node_types"]
    gpu_types = [t for t, v in types.items() if v["resources"].get("GPU")]
    assert gpu_types and config["head_node_type"] not in gpu_types
    (gpu,) = gpu_types
    assert types[gpu]["resources"]["GPU"] == cluster_gpus(compose_config(["cluster=8gpu", "model=qwen3_8b"]))
    assert types[gpu]["min_workers"] >= 1
    assert any("-v /mnt/shared:/mnt/shared" in o for o in config["docker"]["run_options"])


def _gpu_count_as_text(c):
    c["available_node_types"]["gpu_8x"]["resources"]["GPU"] = "8"


def _misspelt_node_field(c):
    c["available_node_types"]["gpu_8x"]["min_worker"] = c["available_node_types"]["gpu_8x"].pop("min_workers")


def _unknown_head_type(c):
    c["head_node_type"] = "ray.head.default"


def _no_provider(c):
    del c["provider"]


@pytest.mark.parametrize("breakage, error", [
    (_gpu_count_as_text, jsonschema.ValidationError),
    (_misspelt_node_field, jsonschema.ValidationError),
    (_unknown_head_type, ValueError),
    (_no_provider, jsonschema.ValidationError),
])
def test_a_broken_ray_up_config_fails(breakage, error):
    config = load_yaml(DEPLOY / "ray-up.yaml")
    breakage(config)
    with pytest.raises(error):
        ray_up_check(config)


# ----------------------------------------------------------------------------- the image
def ray_requirement():
    """The Ray versions the package accepts (pyproject.toml), as a packaging SpecifierSet."""
    from packaging.requirements import Requirement

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (ray,) = [Requirement(d) for d in deps if re.match(r"ray\b", d)]
    return ray.specifier


def image_ray() -> str:
    """The Ray of the image every node runs (deploy/Dockerfile's base image)."""
    (base,) = re.findall(r"^FROM rayproject/ray:(\d+\.\d+\.\d+)-", dockerfile(), re.M)
    return base


def dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def dockerfile_arg(name: str) -> str:
    return re.search(rf"^ARG {name}=(\S+)$", dockerfile(), re.M).group(1)


def test_dockerfile_base_image_matches_the_pins():
    (base,) = re.findall(r"^FROM (\S+)", dockerfile(), re.M)
    m = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)-cu(\d+)", base)
    assert m, base
    ray_version, major, minor, cuda = m.groups()
    assert ray_version == image_ray() and ray_requirement().contains(ray_version)   # one the package accepts
    # the image's Python: the one this project is tested with, allowed by requires-python
    assert (int(major), int(minor)) == sys.version_info[:2]
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert (int(major), int(minor)) >= tuple(int(x) for x in requires.lstrip(">=").split("."))
    # torch's CUDA build for the image's CUDA, and the torch the CPU set-up pins
    assert dockerfile_arg("TORCH_INDEX_URL").rstrip("/").endswith(f"/cu{cuda}")
    bootstrap = re.search(r"TORCH_SPEC=\$\{TORCH_SPEC:-(\S+)\}", (REPO / "scripts" / "bootstrap.sh").read_text())
    install = re.search(r"TORCH_SPEC=\$\{TORCH_SPEC:-(\S+)\}", (DEPLOY / "install.sh").read_text())
    assert dockerfile_arg("TORCH_SPEC") == bootstrap.group(1) == install.group(1)
    assert re.search(r"^RUN .*\bbash deploy/install\.sh\b", dockerfile(), re.M)


@pytest.mark.slow   # pip installs the project into a throwaway venv
def test_install_script_runs_here(tmp_path, tiny_data):
    """deploy/install.sh as the Dockerfile RUNs it (in WORKDIR, on the files it COPYs, PROJECT_DIR=.): pip
    builds the project's wheel and installs it (not editable) into a fresh environment that sees .venv's
    packages (no index: torch, Ray and dflash are already there). Then, outside any source tree, the
    installed copy finds its own presets: the RayJob's entrypoint composes, and the installed `dflash-ray`
    command prints a real preset's config and plans the tiny shards."""
    workdir = re.search(r"^WORKDIR (\S+)$", dockerfile(), re.M).group(1)
    project = tmp_path / "image" / workdir.lstrip("/")
    for line in re.findall(r"^COPY (.+)$", dockerfile(), re.M):
        *sources, dest = [w for w in line.split() if not w.startswith("--")]
        for src in sources:  # Docker's rules: a directory's contents go into dest; a file into dest/ or as dest
            source = REPO / src
            if source.is_dir():
                shutil.copytree(source, project / dest, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target = project / dest / source.name if dest.endswith("/") else project / dest
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(source, target)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "dflash_ray_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {**os.environ, "PYTHON": str(py), "TORCH_SPEC": dockerfile_arg("TORCH_SPEC"), "TORCH_INDEX_URL": "",
           "PROJECT_DIR": ".", "PIP_FLAGS": "--no-index --no-build-isolation --disable-pip-version-check"}
    t0 = time.perf_counter()
    out = subprocess.run(["bash", "deploy/install.sh"], cwd=project, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(f"install.sh: {time.perf_counter() - t0:.1f} s")
    last = out.stdout.strip().splitlines()[-1]
    # the project went into the new environment (not .venv's editable copy), beside .venv's Ray and torch
    import ray

    assert last.startswith(f"installed: dflash-ray 0.1.0 ({site}/dflash_ray), ray {ray.__version__}, torch 2.13.0"), last
    from omegaconf import OmegaConf

    env = {k: v for k, v in os.environ.items() if k not in ("DFLASH_RAY_CONF", "PYTHONPATH")}   # the installed copy only
    overrides = shlex.split(load_yaml(DEPLOY / "kuberay" / "rayjob.yaml")["spec"]["entrypoint"])[3:]
    code = ("import sys, dflash_ray.config as c; cfg = c.compose_config(sys.argv[1:]); "
            "print(c.__file__, c.CONF_DIR, cfg.cluster.name, cfg.model.name)")
    composed = subprocess.run([str(py), "-c", code, *overrides], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert composed.returncode == 0, composed.stderr[-2000:]
    assert composed.stdout.split() == [f"{site}/dflash_ray/config.py", f"{site}/dflash_ray/conf", "8gpu", "qwen3_8b"]
    # the installed command: every preset group is there (a real preset's values, not the schema's defaults)
    cmd = str(venv / "bin" / "dflash-ray")
    job = subprocess.run([cmd, "train", "--cfg", "job", "model=qwen3_8b", "cluster=8gpu"], cwd=tmp_path,
                         capture_output=True, text=True, env=env)
    assert job.returncode == 0, job.stderr[-2000:]
    printed = OmegaConf.create(job.stdout)
    assert printed.model.name == "qwen3_8b" and printed.cluster.target_workers == 6 and printed.train.epochs == 6
    for group in ("model", "data", "cluster", "train"):   # each option shipped, none left behind
        shipped = sorted(q.name for q in Path(site, "dflash_ray", "conf", group).glob("*.yaml"))
        assert shipped == sorted(q.name for q in (REPO / "dflash_ray" / "conf" / group).glob("*.yaml")), group
    plan = subprocess.run([cmd, "plan", "--json", *tiny_data], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert json.loads(plan.stdout)["tokens"] > 0