#!/usr/bin/env bash
# Installs, with no network, what scripts/airgap-wheelhouse.sh built, on a node of an air-gapped GPU cluster
# whose image has CUDA torch, transformers, pyarrow, ... but no Ray: the wheelhouse's wheels into python3's
# environment (the image's own; PYTHON names another), then this project from the source tree copied beside
# it (editable, --no-deps). Prints how long it took. Run it on every node (or bake the result into the image).
#   bash scripts/airgap-install.sh [WHEELHOUSE]     # default .wheelhouse, at the project's root
# Exit 2 with one line when a package is missing (neither in the image nor in the wheelhouse), too old in the
# image for what the wheelhouse's packages ask, or the install does not import.
# Environment: PYTHON (default python3); AIRGAP_INSTALL_NO_DEPS=1 installs the wheels as they are (pip
# --no-deps), past a too-old image package: what Ray asked for may then misbehave.
set -uo pipefail
cd "$(dirname "$0")/.."
WH=${1:-.wheelhouse}
PY=${PYTHON:-python3}
t0=$(date +%s.%N)
die() { echo "airgap-install: $*" >&2; exit 2; }
[ -f "$WH/MANIFEST.json" ] || die "no wheelhouse at $WH (build it with scripts/airgap-wheelhouse.sh and copy it here)"
command -v "$PY" >/dev/null || die "no $PY"

# What the wheelhouse's packages ask of the image's: each installed, each new enough (one line for all that fail)
"$PY" - "$WH/MANIFEST.json" "${AIRGAP_INSTALL_NO_DEPS:-}" <<'PYEOF' || exit 2
import json, sys
from importlib import metadata
try:
    from packaging.specifiers import SpecifierSet
except ImportError:
    from pip._vendor.packaging.specifiers import SpecifierSet
manifest = json.load(open(sys.argv[1]))
bad = []
for name, specs in manifest.get("on_image_not_carried", {}).items():
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        bad.append(f"{name} (missing)")
        continue
    want = SpecifierSet(",".join(s for s in specs if s != "*"))
    if not want.contains(have, prereleases=True):
        bad.append(f"{name} {have} (wants {want})")
if bad:
    line = ("airgap-install: the image's packages do not fit what the wheelhouse asks: " + "; ".join(bad)
            + " -- rebuild with WHEELHOUSE_ALSO=" + ",".join(b.split()[0] for b in bad)
            + " or rerun with AIRGAP_INSTALL_NO_DEPS=1")
    if sys.argv[2]:
        print(line.replace("airgap-install:", "airgap-install: warning:"), file=sys.stderr)
    else:
        print(line, file=sys.stderr)
        sys.exit(2)
PYEOF

wheels=()
for w in "$WH"/*.whl; do
  [ -f "$w" ] && wheels+=("$w")
done
[ ${#wheels[@]} -gt 0 ] || die "no wheels in $WH"
nodeps=()
[ -n "${AIRGAP_INSTALL_NO_DEPS:-}" ] && nodeps=(--no-deps)
log=$(mktemp /tmp/airgap-install.XXXXXX.log)
if ! "$PY" -m pip install --no-index --find-links "$WH" --no-compile --disable-pip-version-check -q \
    "${nodeps[@]}" "${wheels[@]}" >"$log" 2>&1; then
  why=$(grep -m1 -E "^ERROR: (Could not find|No matching|Cannot install|ResolutionImpossible|.*conflict)" "$log" \
        || grep -m1 "^ERROR" "$log" || tail -n1 "$log")
  die "pip could not install $WH: $why (log: $log)"
fi
t1=$(date +%s.%N)

# The project: editable from this tree (the source copied here is what runs); where that fails (no setuptools
# >= 68 in the image), a .pth file puts the tree on sys.path: `python3 -m dflash_ray` works, the `dflash-ray`
# command is then missing
if ! "$PY" -m pip install --no-index --no-deps --no-build-isolation --no-compile --disable-pip-version-check -q \
    -e . >>"$log" 2>&1; then
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$PWD" > "$site/dflash_ray_tree.pth" \
    || die "the project did not install (editable, nor a .pth in $site; log: $log)"
  echo "airgap-install: editable install failed (log: $log); $site/dflash_ray_tree.pth puts $PWD on sys.path" >&2
fi

# It imports, and Ray's binaries kept their executable bits
ver=$("$PY" - <<'PYEOF'
import os, sys
try:
    import hydra, omegaconf, ray, ray.data, ray.train, dflash_ray.cli  # noqa: F401
except Exception as e:
    sys.exit(f"airgap-install: the install does not import: {type(e).__name__}: {e}")
root = os.path.dirname(ray.__file__)
for rel in ("core/src/ray/gcs/gcs_server", "core/src/ray/raylet/raylet"):
    if not os.access(os.path.join(root, rel), os.X_OK):
        sys.exit(f"airgap-install: {os.path.join(root, rel)} is not executable")
print(ray.__version__)
PYEOF
) || exit 2
t2=$(date +%s.%N)
printf 'airgap-install: %d wheels from %s in %.1f s, the project and the import check in %.1f s (ray %s; %s)\n' \
  "${#wheels[@]}" "$WH" "$(awk "BEGIN{print $t1 - $t0}")" "$(awk "BEGIN{print $t2 - $t1}")" "$ver" \
  "$(command -v ray || echo "no ray on PATH: $(dirname "$(command -v "$PY")")")"
