#!/usr/bin/env bash
# Download every wheel scripts/gpu_check.sh needs on a GPU image that has Python, a CUDA torch,
# Triton and numpy but no network: ./scripts/gpu_wheels.sh [DIR] [--python-version X.Y]
# (defaults .whl/ and 3.12; CPython, manylinux x86_64). Run it where pip reaches PyPI.
#
# pip resolves the dependencies for the target interpreter (nothing is guessed); what a stock
# CUDA image already has (torch, triton, numpy, nvidia-*, cuda-*) is dropped. DIR/gpu_wheels.txt
# records the target Python and each wheel; gpu_check.sh installs exactly those files.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
DIR="" PYVER="3.12"
usage="usage: scripts/gpu_wheels.sh [DIR] [--python-version X.Y]"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python-version) [[ $# -ge 2 ]] || { echo "gpu_wheels: --python-version needs X.Y" >&2; exit 2; }
                      PYVER="$2"; shift 2 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    -*) echo "gpu_wheels: unknown option $1; $usage" >&2; exit 2 ;;
    *) [[ -z "$DIR" ]] || { echo "gpu_wheels: more than one DIR; $usage" >&2; exit 2; }
       DIR="$1"; shift ;;
  esac
done
[[ "$PYVER" =~ ^3\.[0-9]+$ ]] || { echo "gpu_wheels: --python-version must be 3.N, got '$PYVER'" >&2; exit 2; }
DIR="${DIR:-$ROOT/.whl}"
# One call to the GPU machine carries at most 64 MiB (wheels and the tree together); the first
# call keeps to 40, so the tree and the wheels can grow without the call failing before it starts.
MAX_MIB=40

# What the GPU check imports (scripts/gpu_imports.py) and what its first stage's trainer run
# needs, as distributions. torchtitan comes without its declared dependencies: of them the
# trainer imports datasets (with pyarrow and pandas), torchdata, tyro, spmd_types and tokenizers;
# wandb and tensorboard (both off in the check; compat.py covers a missing tensorboard) and
# pillow are left out. pyarrow and pandas (40.8 + ~12 MiB, most of the old 60) are not carried:
# the image has both (docs/gpu.md, "The GPU image"). fla-core imports packaging at module level
# without declaring it.
NO_DEPS=(torchtitan==0.3.0)
WITH_DEPS=(fla-core==0.6.0 packaging spmd_types==0.2.3 tyro pytest datasets==4.7.0 torchdata)
# What the GPU image already has (docs/gpu.md, "The GPU image"; scripts/gpu_image_check.sh
# installs the same list into its emulated image): torch with its CUDA libraries and its own
# dependencies but fsspec (datasets caps its version), triton, numpy, and the packages below with
# their dependencies (huggingface_hub brings hf-xet; pandas python-dateutil, pytz, tzdata and
# six). Normalised names.
IMAGE_HAS='^(torch|triton|numpy|nvidia-.*|cuda-.*|sympy|mpmath|networkx|jinja2|markupsafe|filelock|setuptools|typing-extensions|tokenizers|huggingface-hub|hf-xet|safetensors|pytest|pluggy|iniconfig|hypothesis|sortedcontainers|attrs|rich|pygments|markdown-it-py|mdurl|pyarrow|pandas|python-dateutil|pytz|tzdata|six)$'
# Declared but not imported by the check: aiohttp and its stack (fsspec's http filesystem, for
# streaming remote datasets; datasets imports it only if present). 2.9 MiB of the 64.
NOT_NEEDED='^(aiohttp|aiohappyeyeballs|aiosignal|multidict|yarl|propcache|frozenlist)$'

TARGET=(--only-binary=:all: --implementation cp --python-version "$PYVER"
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64)
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
# The image's torch stands in as a metadata-only wheel (version IMAGE_TORCH+image, no
# dependencies), pinned by a constraint: the resolve then takes what the image has as given, as
# the install on the image does. Resolving PyPI's torch instead pulled its CUDA stack's metadata
# and backtracked through nine torch releases (about 100 s and 1 GiB of downloads per run) for
# wheels that are all dropped below.
IMAGE_TORCH=2.11.0
mkdir -p "$TMP/provided"
"$PY" - "$TMP/provided" "$IMAGE_TORCH+image" <<'PY'
import sys, zipfile
folder, version = sys.argv[1], sys.argv[2]
info = f"torch-{version}.dist-info"
with zipfile.ZipFile(f"{folder}/torch-{version}-py3-none-any.whl", "w") as whl:
    whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    whl.writestr(f"{info}/RECORD", "")
PY
echo "torch==$IMAGE_TORCH+image" > "$TMP/image.txt"
# Resolve (metadata only, nothing is installed) for the target interpreter.
"$PY" -m pip install -q --dry-run --ignore-installed --target "$TMP/t" --report "$TMP/deps.json" \
  --find-links "$TMP/provided" -c "$TMP/image.txt" "${TARGET[@]}" "${WITH_DEPS[@]}"
"$PY" -m pip install -q --dry-run --ignore-installed --no-deps --target "$TMP/t" \
  --report "$TMP/nodeps.json" "${TARGET[@]}" "${NO_DEPS[@]}"
"$PY" - "$TMP" "$IMAGE_HAS|$NOT_NEEDED" > "$TMP/pins.txt" <<'EOF'
import json, re, sys
tmp, skip = sys.argv[1], re.compile(sys.argv[2])
seen = set()
for report in ("nodeps", "deps"):
    for item in json.load(open(f"{tmp}/{report}.json"))["install"]:
        name = re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower()
        if name not in seen and not skip.match(name):
            seen.add(name)
            print(f"{name}=={item['metadata']['version']}")
EOF
mkdir -p "$DIR"
mapfile -t PINS < "$TMP/pins.txt"
"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$TMP/dl" "${PINS[@]}"
MANIFEST="# scripts/gpu_wheels.sh: CPython $PYVER, manylinux x86_64; gpu_check.sh installs these
python $PYVER"
total=0
for pin in "${PINS[@]}"; do
  name="${pin%%==*}" version="${pin#*==}"
  # Wheel file names spell the project with underscores and any case.
  file="$(cd "$TMP/dl" && ls | grep -i -E "^${name//-/[-_.]}-${version//./\\.}-.*\\.whl$" | head -1)"
  [[ -n "$file" ]] || { echo "gpu_wheels: pip fetched no wheel for $pin" >&2; exit 1; }
  mv -f "$TMP/dl/$file" "$DIR/$file"
  total=$((total + $(stat -c %s "$DIR/$file")))
  MANIFEST+=$'\n'"$pin $file"
done
echo "$MANIFEST" > "$DIR/gpu_wheels.txt"
sed -n '3,$p' "$DIR/gpu_wheels.txt"
# The tree travels with every call too: tracked files and untracked ones git does not ignore.
tree=0
while IFS= read -r -d '' f; do
  [[ -f "$ROOT/$f" ]] && tree=$((tree + $(stat -c %s "$ROOT/$f")))
done < <(git -C "$ROOT" ls-files -z --cached --others --exclude-standard)
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
echo "gpu_wheels: ${#PINS[@]} wheels for CPython $PYVER in $DIR, $(mib "$total") MiB; the tree" \
  "$(mib "$tree") MiB; together $(mib $((total + tree))) MiB (limit $MAX_MIB MiB)"
if (( total + tree > MAX_MIB * 1048576 )); then
  echo "gpu_wheels: wheels $(mib "$total") MiB + tree $(mib "$tree") MiB exceed the $MAX_MIB MiB" \
    "the first GPU call may carry" >&2
  exit 1
fi
