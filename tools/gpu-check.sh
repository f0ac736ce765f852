#!/usr/bin/env bash
# The offline GPU check (issue 31), one command on a borrowed GPU node:
#
#     tools/gpu-check.sh OUT [--device cuda|cpu] [--small] [--steps ...] [--budget SECONDS]
#
# On a lease: `tools/gpu-check.sh OUT --budget 540` (9 minutes, the install included: the steps run most valuable
# first and a step that does not fit is skipped and listed in gpu-check.json; gpucheck/budget.py).
#
# 1. installs the kit (.gpukit/, made by `make gpu-kit`) and dtbench itself into a folder of their own with
#    pip --no-index --no-deps, ON TOP of the node's Python and its torch: nothing of the node is replaced (the torch
#    that imports afterwards is checked to be the node's);
# 2. runs `python -m dtbench.gpucheck --out OUT ...` (gpucheck/): OUT/gpu-check.json and OUT/gpu-check.log.
#
# Environment: PYTHON (default python3, the node's), GPUKIT (default .gpukit), SITE (default /tmp/dtbench-site).
# Exit code: the check's (0 passed, 1 a step failed, 2 bad arguments); 3 when the install fails.
set -uo pipefail
CALLER_DIR=$PWD  # a relative OUT is the caller's, not the checkout's (the script runs from the checkout's root)
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: tools/gpu-check.sh OUT [--device cuda|cpu] [--small] [--steps lossless,timing,...] [--budget SECONDS]" >&2
  exit 2
fi
OUT=$1; shift
case "$OUT" in /*) ;; *) OUT="$CALLER_DIR/$OUT" ;; esac
PYTHON=${PYTHON:-python3}
# the arguments first: a typo is one line and exit 2 before anything is installed (issue 67; standard library only)
"$PYTHON" tools/gpu_check_args.py "$@" || exit 2
GPUKIT=${GPUKIT:-.gpukit}
SITE=${SITE:-/tmp/dtbench-site}
# OUT must be a folder this script can write: one line and exit 2 otherwise (never raw mkdir/tee errors, never a
# pointer to a log that cannot exist)
if [ -e "$OUT" ] && [ ! -d "$OUT" ]; then
  echo "error: OUT $OUT exists and is not a folder: give a folder (new or existing) for gpu-check.json and its log" >&2
  exit 2
fi
if ! mkdir -p "$OUT" 2>/dev/null || ! touch "$OUT/gpu-check.log" 2>/dev/null; then
  echo "error: cannot create or write the folder OUT $OUT (check its parent and permissions)" >&2
  exit 2
fi
LOG="$OUT/gpu-check.log"
say() { echo "$*" | tee -a "$LOG"; }
if ! ls "$GPUKIT"/*.whl >/dev/null 2>&1; then
  say "error: no wheels in $GPUKIT/: run \`make gpu-kit\` on a machine with network first"; exit 3
fi
torch_before=$("$PYTHON" -c 'import torch; print(torch.__version__, torch.__file__)' 2>/dev/null || echo "none")
say "node: $("$PYTHON" --version 2>&1), torch $torch_before"
rm -rf "$SITE"
t0=$(date +%s)
# The kit's wheels, then dtbench from this checkout (setuptools is the node's: no build isolation, no index).
if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$GPUKIT"/*.whl \
     >>"$LOG" 2>&1 \
   || ! "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" . \
     >>"$LOG" 2>&1; then
  say "error: installing the kit or dtbench failed (see $LOG)"; exit 3
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
torch_after=$("$PYTHON" -c 'import torch; print(torch.__version__, torch.__file__)' 2>/dev/null || echo "none")
if [ "$torch_after" != "$torch_before" ]; then
  say "error: the install changed the torch that imports ($torch_before -> $torch_after)"; exit 3
fi
say "installed $(ls "$GPUKIT"/*.whl | wc -l) wheels and dtbench into $SITE in $(( $(date +%s) - t0 )) s"
# -P: the checkout's own dtbench/ folder (dtbench.core, dtbench.api) must not shadow the installed package
PYTHONUNBUFFERED=1 "$PYTHON" -P -m dtbench.gpucheck --out "$OUT" --spent "$(( $(date +%s) - t0 ))" "$@"
