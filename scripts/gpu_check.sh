#!/usr/bin/env bash
# scripts/gpu_check.sh --wheels DIR --out OUT [--parts P1,P2] [--deadline-s S]
# On a GPU machine without network: every GPU path of the template, checked and timed in one call.
# - a venv over the machine's Python (--system-site-packages: its torch, torchvision and Lightning stay), with the
#   wheelhouse of scripts/wheelhouse.sh installed by pip --no-index;
# - the GPU, driver, torch, CUDA, cuDNN and NCCL versions;
# - the GPU decode's part (`decode`: its CUDA tests with their defects put back, then one bench call), `pytest -m gpu`,
#   then `python -m bench gpu` group by group, each under its own timeout, within 8 minutes (scripts/gpu_check.py);
# - OUT/gpu-check.md and OUT/gpu-check.json, naming the GPU and the date (scripts/gpu_check.py).
# Exit status: 0 when every part passed and at least one GPU row ran; 2 without a usable CUDA device; 1 when a
# part failed or every row was skipped. PYTHON picks the machine's Python (default python3). --parts runs some parts
# (by their words: decode, the GPU decode's part; gpu, mutants, ceiling, trainer, input, clusters, backends,
# precision, flags, dali, ddp, powersgd, engines, trace, ema; an unknown word stops it, exit 2), --deadline-s sets
# the limit. A line says when each step starts.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
usage="usage: scripts/gpu_check.sh --wheels DIR --out OUT [--parts P1,P2] [--deadline-s S]"
wheels="" out="" extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels=${2:-}; shift 2 ;;
    --out) out=${2:-}; shift 2 ;;
    --parts|--deadline-s) extra+=("$1" "${2:-}"); shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
[ -n "$wheels" ] && [ -n "$out" ] || { echo "$usage" >&2; exit 2; }
[ -d "$wheels" ] || { echo "gpu_check.sh: --wheels $wheels is not a folder: make it with scripts/wheelhouse.sh on a machine with network." >&2; exit 2; }
python=${PYTHON:-python3}
export GPU_CHECK_STARTED=${GPU_CHECK_STARTED:-$(date +%s)}  # the 8 minutes count from here (scripts/gpu_check.py)
mkdir -p "$out"
venv="$out/venv"
step() { echo "gpu_check: $1 ($(( $(date +%s) - GPU_CHECK_STARTED )) s in)"; }
step "a venv over $("$python" -c 'import sys; print(sys.executable)') in $venv"
"$python" -m venv --system-site-packages "$venv" || exit 1
# A venv's --system-site-packages reaches the base interpreter only: when the machine's Python is itself a venv
# (CI's rehearsal), its packages are added behind the new venv's own.
outer=$("$python" -c 'import site, sys; print(site.getsitepackages()[0] if sys.prefix != sys.base_prefix else "")')
inner=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
[ -z "$outer" ] || echo "$outer" > "$inner/machine_python.pth"
# --no-deps: scripts/wheelhouse.txt is closed under what the image lacks; the import below proves it
step "installing the wheelhouse from $wheels offline ($(grep -cv '^ *\(#\|$\)' scripts/wheelhouse.txt) requirements; about 2 minutes on a small machine), then importing it"
if ! "$venv/bin/python" -m pip install --quiet --no-index --no-deps --find-links "$wheels" -r scripts/wheelhouse.txt \
   || ! "$venv/bin/python" -c "import jsonargparse, lmdb, litdata, obstore, boto3, torchdata, optuna"; then
  echo "gpu_check.sh: the wheelhouse $wheels does not install offline: make it with scripts/wheelhouse.sh for this Python ($("$python" -V))." >&2
  exit 1
fi
step "the check itself (scripts/gpu_check.py)"
exec "$venv/bin/python" scripts/gpu_check.py --out "$out" "${extra[@]}"
