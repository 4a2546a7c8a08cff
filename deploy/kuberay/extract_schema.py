"""Write the RayJob CRD's OpenAPI v3 schema (version v1) as JSON, from KubeRay's CRD file.

    git -C kuberay show v1.7.0:ray-operator/config/crd/bases/ray.io_rayjobs.yaml > ray.io_rayjobs.yaml
    python deploy/kuberay/extract_schema.py ray.io_rayjobs.yaml v1.7.0 59d663aeec13760646da3db9c1cf8cfe883e30b7 \
        > deploy/kuberay/ray.io_rayjobs.schema.json

The schema is taken as it is (`spec.versions[name == v1].schema.openAPIV3Schema`); a `$comment` naming the
source is added at its top (JSON Schema ignores it).
"""
import hashlib
import json
import sys

import yaml


def main(crd_path: str, tag: str, commit: str) -> None:
    raw = open(crd_path, "rb").read()
    crd = yaml.safe_load(raw)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = version["schema"]["openAPIV3Schema"]
    source = (f"KubeRay {tag} (commit {commit}), ray-operator/config/crd/bases/ray.io_rayjobs.yaml "
              f"(sha256 {hashlib.sha256(raw).hexdigest()}): spec.versions[v1].schema.openAPIV3Schema")
    json.dump({"$comment": source, **schema}, sys.stdout, sort_keys=True, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
