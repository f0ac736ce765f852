#!/usr/bin/env bash
# `make gpu-check-dry` (issue 31): the GPU node's check rehearsed on this CPU, so that a missing wheel or a kit that
# is too large fails here, not on the node.
#
# 1. `make gpu-kit` has built .gpukit/ (the node's kit: CPython 3.12 wheels) and checked its size.
# 2. A venv that mirrors the node as dtbench sees it: torch 2.13.0 (CPU) standing in for the node's 2.11, and of the
#    node's package list (tools/gpu-node.txt) the packages dtbench, the kit's wheels and the tests need, at the node's
#    versions where the list gives them and this Python has them (`cli/offline.py gpukit-mirror`). Any package pip
#    pulls in that is NOT on the node's list is uninstalled again, so nothing but the kit can fill a gap.
# 3. The same closure built for THIS Python (.gpukit-dry/: a CPU-only machine here has torch 2.13.0 for Python 3.11
#    only, so the rehearsal runs on 3.11; the package set is the node kit's, checked equal), installed with
#    --no-index --no-deps by tools/gpu-check.sh, which then runs the check with --device cpu --small.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${DRY_PYTHON:-python3}
VENV=${DRY_VENV:-.venv-gpu-dry}
OUT=${DRY_OUT:-gpu-check-dry}
ver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q torch==2.13.0 packaging
fi
mirror=$("$PY" cli/offline.py gpukit-mirror --python-version "$ver")
for req in $mirror; do  # the node's version where this Python has it, else the newest that installs here
  "$VENV/bin/python" -m pip install -q "$req" 2>/dev/null || "$VENV/bin/python" -m pip install -q "${req%%==*}"
done
# Nothing but the node's packages (and torch's stack, pip's own tools) may stay in the mirror.
extra=$("$VENV/bin/python" - <<'PY'
import re
from importlib import metadata
node = {re.sub(r"[-_.]+", "-", l.split("#")[0].split("==")[0].strip()).lower()
        for l in open("tools/gpu-node.txt") if l.split("#")[0].strip()}
keep = {"pip", "setuptools", "wheel", "packaging", "torch", "triton"}
names = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in metadata.distributions()}
print(" ".join(sorted(n for n in names if n not in node and n not in keep and not n.startswith("nvidia-"))))
PY
)
if [ -n "$extra" ]; then
  echo "gpu-check-dry: not on the node's list, removed from the mirror: $extra"
  "$VENV/bin/python" -m pip uninstall -y -q $extra
fi
"$VENV/bin/python" cli/offline.py gpukit --dest .gpukit-dry --python-version "$ver" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
# The dry kit must hold the same packages as the node's kit (versions may differ where a wheel is per-Python).
"$VENV/bin/python" - <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "cli")
from offline import wheel_name_version
names = lambda d: sorted(wheel_name_version(p)[0] for p in Path(d).glob("*.whl"))
if names(".gpukit") != names(".gpukit-dry"):
    sys.exit(f"error: the node's kit {names('.gpukit')} and the dry kit {names('.gpukit-dry')} differ")
print(f"gpu-check-dry: the dry kit holds the node kit's {len(names('.gpukit'))} packages")
PY
rm -rf "$OUT"
PYTHON="$VENV/bin/python" GPUKIT=.gpukit-dry SITE="${TMPDIR:-/tmp}/dtbench-site-dry" \
  tools/gpu-check.sh "$OUT" --device cpu --small
"$VENV/bin/python" -c "
import json; r = json.load(open('$OUT/gpu-check.json')); print('gpu-check-dry:', 'ok' if r['ok'] else 'FAILED', json.dumps(r['summary'])[:400])"
# The lease's plan (issue 46 item 7): planned minutes per step on a GPU against the 9-minute budget, and the steps'
# seconds here; then the curves file and --predict-on end to end on the dry run's own smoke database (issue 48).
PYTHONPATH="${TMPDIR:-/tmp}/dtbench-site-dry" "$VENV/bin/python" -P -m dtbench.gpucheck --out "$OUT" --plan
"$VENV/bin/python" -c "
import json; r = json.load(open('$OUT/gpu-check.json'))
print('gpu-check-dry: seconds here:', ', '.join(f'{k} {v.get(\"seconds\", 0):.0f}' for k, v in r['steps'].items()))
p = r['steps'].get('smoke', {}).get('prediction') or {}
print('gpu-check-dry: smoke predicted from its own curves:', p.get('curves'), 'speedup MAE', p.get('speedup_mae'))"
