"""Each decoder step runs in child processes (``python -X faulthandler -m dtbench.gpucheck --child STEP``), so a
crash of native code fails one row, not the check (:func:`run_step`); :func:`run_child` is the child's side."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

from dtbench.gpucheck import common
from dtbench.gpucheck.common import PYTHIA_2_8B, PYTHIA_70M, SMALL_DRAFT, SMALL_TARGET, lossless_decoders, neox
from dtbench.gpucheck.compiled import step_compiled
from dtbench.gpucheck.costmodel import step_costmodel
from dtbench.gpucheck.lossless import step_lossless
from dtbench.gpucheck.overhead import OVERHEAD_DECODERS, step_overhead
from dtbench.gpucheck.timing import step_timing


def expected_ids(step: str, device, small: bool) -> list[str]:
    """Row ids of a decoder step in the order the step runs them (to name the row a crashed child was on)."""
    if step == "lossless":
        half = "float16" if device.type == "cuda" else "bfloat16"
        archs = ("llama",) if small else ("llama", "neox")
        return [f"{a}/{d}/{i}" for a in archs for d in ("float32", half) for i in range(len(lossless_decoders()))]
    if step == "overhead":
        return [str(i) for i, (n, _) in enumerate(OVERHEAD_DECODERS) if common.ONLY is None or n in common.ONLY]
    return []


def _describe(step: str, rid: str) -> dict:
    if step == "lossless":
        arch, dtype, i = rid.split("/")
        name, params = lossless_decoders()[int(i)]
        return {
            "arch": arch,
            "dtype": dtype,
            "decoder": name,
            "rule": "exact" if dtype == "float32" else "tie_aware",
            "params": {k: v for k, v in params.items() if not str(v).startswith("<")},
        }
    name, params = OVERHEAD_DECODERS[int(rid)]
    return {"decoder": name, "params": params}


def build_models(device, small: bool):
    """(target, draft, description): GPT-NeoX at Pythia-2.8B/70M shapes (fp16 on CUDA, fp32 on a CPU) or small."""
    import torch

    from dtbench.harness.calibration.curves_file import model_shape

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    shapes = (SMALL_TARGET, SMALL_DRAFT) if small else (PYTHIA_2_8B, PYTHIA_70M)
    target, draft = neox(shapes[0], dtype, device, seed=0), neox(shapes[1], dtype, device, seed=1)
    desc = {
        "target": shapes[0],
        "draft": shapes[1],
        "dtype": str(dtype).removeprefix("torch."),
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "draft_parameters": sum(p.numel() for p in draft.parameters()),
        "target_shape": model_shape(target.config),  # what a curves file's prediction must match (issue 48)
        "draft_shape": model_shape(draft.config),
    }
    return target, draft, desc


def run_child(step: str, device, small: bool, rows_file: Path, skip: frozenset, log) -> None:
    """One step in this (child) process: rows and the step's result appended to ``rows_file`` as JSON lines."""

    def emit(obj: dict) -> None:
        with rows_file.open("a", encoding="utf-8") as f:
            f.write(json.dumps(obj, default=str) + "\n")

    workdir = Path(tempfile.mkdtemp(prefix="dtbench-gpucheck-"))
    models = None
    try:
        if step == "lossless":
            res = step_lossless(device, small, workdir, log, skip, lambda r: emit({"row": r}))
        else:
            target, draft, models = build_models(device, small)
            log(
                f"built target ({models['target_parameters'] / 1e9:.2f} B parameters) and draft "
                f"({models['draft_parameters'] / 1e6:.1f} M) in {models['dtype']}"
            )
            if step == "timing":
                res = step_timing(device, target, log)
            elif step == "costmodel":
                res = step_costmodel(device, target, draft, small, log)
            elif step == "compiled":
                res = step_compiled(device, target, draft, small, workdir, log)
            else:
                res = step_overhead(device, target, draft, small, workdir, log, skip, lambda r: emit({"row": r}))
    except Exception as exc:  # the step failed in Python: recorded, the parent goes on
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-2000:]}
        log(f"{step} FAILED: {res['error']}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # the heads and datastores written for the step
    res.pop("rows", None) if step in ("lossless", "overhead") else None
    emit({"result": res, "models": models})


# --- tests: the hypothesis property suite on this device (issue 38 item 3) -----------------------------------------


MAX_CRASHES = 8  # child processes a step may lose to crashes (a segfault in a decoder) before it gives up


def run_step(step: str, argv_base: list[str], device, small: bool, out_dir: Path, log) -> tuple[dict, dict | None]:
    """Run ``step`` in child processes (``python -X faulthandler``), so a crash of native code (a segfault) fails one
    row, not the check: the row the child was on is recorded as crashed with the tail of the child's stderr (the
    faulthandler's Python traceback), and a new child goes on after it."""
    import subprocess

    rows: dict[str, dict] = {}
    skip: set[str] = set()
    result, models = None, None
    rows_file = out_dir / f".{step}.jsonl"
    for _attempt in range(MAX_CRASHES + 1):
        rows_file.unlink(missing_ok=True)
        err_file = out_dir / f"{step}.stderr"
        cmd = [
            sys.executable,
            "-P",
            "-X",
            "faulthandler",
            "-m",
            "dtbench.gpucheck",
            *argv_base,
            "--child",
            step,
            "--rows-file",
            str(rows_file),
            "--skip-ids",
            ",".join(sorted(skip)),
        ]
        with err_file.open("w", encoding="utf-8") as err:
            rc = subprocess.run(cmd, stderr=err).returncode
        lines = rows_file.read_text(encoding="utf-8").splitlines() if rows_file.exists() else []
        for line in lines:
            obj = json.loads(line)
            if "row" in obj:
                rows[obj["row"]["id"]] = obj["row"]
                skip.add(obj["row"]["id"])
            else:
                result, models = obj["result"], obj.get("models")
        if result is not None:
            break
        trace = err_file.read_text(encoding="utf-8", errors="replace").split("\nExtension modules:")[0][-1500:]
        how = f"crashed (signal {-rc})" if rc < 0 else f"child exited with {rc} and no result"
        pending = [i for i in expected_ids(step, device, small) if i not in skip]
        if not pending:
            result = {"ok": False, "error": f"{step} {how}", "crash_trace": trace}
            break
        crashed = pending[0]
        rows[crashed] = {"id": crashed, **_describe(step, crashed), "ok": False, "error": how, "crash_trace": trace}
        skip.add(crashed)
        if step == "lossless":  # the same decoder on the other pairs/dtypes: not retried (each crash costs a child)
            for other in pending[1:]:
                if other.split("/")[-1] == crashed.split("/")[-1]:
                    rows[other] = {
                        "id": other,
                        **_describe(step, other),
                        "ok": False,
                        "error": f"not run: this decoder crashed on {crashed}",
                    }
                    skip.add(other)
        log(f"{step} {crashed} {rows[crashed]['decoder']}: {how}; faulthandler: {trace.strip().splitlines()[-1:]}")
    else:
        result = {"ok": False, "error": f"{step}: more than {MAX_CRASHES} crashes"}
    rows_file.unlink(missing_ok=True)
    if step in ("lossless", "overhead"):
        order = expected_ids(step, device, small)
        result["rows"] = [rows[i] for i in order if i in rows]
        result["ok"] = bool(result.get("ok")) and all(r["ok"] for r in result["rows"]) and bool(result["rows"])
    return result, models
