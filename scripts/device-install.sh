#!/usr/bin/env bash
# Installs what scripts/device-wheelhouse.sh built, with no network, on a GPU machine whose image has CUDA
# torch, transformers, pyarrow, ... but no Ray: the wheelhouse's wheels into python3's environment (the
# image's own, /opt/torch/.venv there: the machine starts bare every time, so nothing outlives it), then this
# project from the tree that travelled (editable, --no-deps). Prints how long it took.
#   bash scripts/device-install.sh [WHEELHOUSE]     # default .wheelhouse, carried beside the repo
# Exit 2 with one line when a package is missing (neither on the machine nor in the wheelhouse), too old on
# the image for what the wheelhouse's packages ask, or the install does not import.
# Environment: PYTHON (default python3); DEVICE_INSTALL_NO_DEPS=1 installs the wheels as they are (pip
# --no-deps), past a too-old image package: what Ray asked for may then misbehave.
set -uo pipefail
cd "$(dirname "$0")/.."
WH=${1:-.wheelhouse}
PY=${PYTHON:-python3}
t0=$(date +%s.%N)
die() { echo "device-install: $*" >&2; exit 2; }
[ -f "$WH/MANIFEST.json" ] || die "no wheelhouse at $WH (build it with scripts/device-wheelhouse.sh, carry it)"
command -v "$PY" >/dev/null || die "no $PY"

# What the carried packages ask of the image's: each installed, each new enough (one line for all that fail)
"$PY" - "$WH/MANIFEST.json" "${DEVICE_INSTALL_NO_DEPS:-}" <<'PYEOF' || exit 2
import json, sys
from importlib import metadata
try:
    from packaging.specifiers import SpecifierSet
except ImportError:
    from pip._vendor.packaging.specifiers import SpecifierSet
manifest = json.load(open(sys.argv[1]))
bad = []
for name, specs in manifest.get("on_device_image_not_carried", {}).items():
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        bad.append(f"{name} (missing)")
        continue
    want = SpecifierSet(",".join(s for s in specs if s != "*"))
    if not want.contains(have, prereleases=True):
        bad.append(f"{name} {have} (wants {want})")
if bad:
    line = ("device-install: the image's packages do not fit what the wheelhouse asks: " + "; ".join(bad)
            + " -- rebuild with WHEELHOUSE_ALSO=" + ",".join(b.split()[0] for b in bad)
            + " or rerun with DEVICE_INSTALL_NO_DEPS=1")
    if sys.argv[2]:
        print(line.replace("device-install:", "device-install: warning:"), file=sys.stderr)
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
[ -n "${DEVICE_INSTALL_NO_DEPS:-}" ] && nodeps=(--no-deps)
log=$(mktemp /tmp/device-install.XXXXXX.log)
if ! "$PY" -m pip install --no-index --find-links "$WH" --no-compile --disable-pip-version-check -q \
    "${nodeps[@]}" "${wheels[@]}" >"$log" 2>&1; then
  why=$(grep -m1 -E "^ERROR: (Could not find|No matching|Cannot install|ResolutionImpossible|.*conflict)" "$log" \
        || grep -m1 "^ERROR" "$log" || tail -n1 "$log")
  die "pip could not install $WH: $why (log: $log)"
fi
t1=$(date +%s.%N)

# The project: editable from this tree (the source that travelled is what runs); where that fails (no setuptools >= 68 there), a .pth file puts the tree on
# sys.path: `python3 -m dflash_ray` works, the `dflash-ray` command is then missing
if ! "$PY" -m pip install --no-index --no-deps --no-build-isolation --no-compile --disable-pip-version-check -q \
    -e . >>"$log" 2>&1; then
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$PWD" > "$site/dflash_ray_tree.pth" \
    || die "the project did not install (editable, nor a .pth in $site; log: $log)"
  echo "device-install: editable install failed (log: $log); $site/dflash_ray_tree.pth puts $PWD on sys.path" >&2
fi

# It imports, and Ray's binaries kept their executable bits
ver=$("$PY" - <<'PYEOF'
import os, sys
try:
    import hydra, omegaconf, ray, ray.data, ray.train, dflash_ray.cli  # noqa: F401
except Exception as e:
    sys.exit(f"device-install: the install does not import: {type(e).__name__}: {e}")
root = os.path.dirname(ray.__file__)
for rel in ("core/src/ray/gcs/gcs_server", "core/src/ray/raylet/raylet"):
    if not os.access(os.path.join(root, rel), os.X_OK):
        sys.exit(f"device-install: {os.path.join(root, rel)} is not executable")
print(ray.__version__)
PYEOF
) || exit 2
t2=$(date +%s.%N)
printf 'device-install: %d wheels from %s in %.1f s, the project and the import check in %.1f s (ray %s; %s)\n' \
  "${#wheels[@]}" "$WH" "$(awk "BEGIN{print $t1 - $t0}")" "$(awk "BEGIN{print $t2 - $t1}")" "$ver" \
  "$(command -v ray || echo "no ray on PATH: $(dirname "$(command -v "$PY")")")"
