#!/usr/bin/env bash
# scripts/wheelhouse.sh DIR [--python 3.12]
# On a machine with network: download exactly the wheels of scripts/wheelhouse.txt (what the project needs beyond a
# GPU image's torch, torchvision, Lightning and the rest of constraints/oldest.txt) for one Python version and
# Linux x86_64, into DIR. Prints each wheel with its size and the total, and refuses (exit 1) above 40 MiB, the
# share of the 64 MiB that travels to an offline GPU machine left to wheels. Then, on that machine:
#   scripts/gpu_check.sh --wheels DIR --out OUT
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/wheelhouse.sh DIR [--python X.Y] (default: this python's version)"
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
dir=$1; shift
py=$("${PYTHON:-python3}" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
while [ $# -gt 0 ]; do
  case "$1" in
    --python) py=${2:?$usage}; shift 2 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
limit_mib=40
abi="cp${py/./}"
mkdir -p "$dir"
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --dest "$dir" \
  --python-version "$py" --implementation cp --abi "$abi" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 --platform any \
  -r scripts/wheelhouse.txt 2> >(grep -v "^WARNING: Location" >&2)
total=0
for wheel in "$dir"/*.whl; do
  size=$(stat -c %s "$wheel")
  total=$((total + size))
  awk -v s="$size" -v n="$(basename "$wheel")" 'BEGIN { printf "%10.1f MiB  %s\n", s / 1048576, n }'
done
awk -v s="$total" -v n="$(ls "$dir"/*.whl | wc -l)" -v py="$py" -v lim="$limit_mib" \
  'BEGIN { printf "%10.1f MiB  total, %d wheels for Python %s (limit %s MiB)\n", s / 1048576, n, py, lim }'
if [ "$total" -gt $((limit_mib * 1048576)) ]; then
  echo "wheelhouse.sh: $dir holds more than $limit_mib MiB: it would not travel with the checkout (64 MiB in all)." >&2
  exit 1
fi
