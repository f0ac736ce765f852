"""The **smoke** step (issue 38 item 4): suites/gpu-smoke.yaml through ``dtbench run`` and ``dtbench report``, the
run's own curves predicting its cells (issue 48); and the paper-shaped curves file of the costmodel step."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from dtbench.gpucheck.common import tests_dir


def step_smoke(device, small: bool, out_dir: Path, log) -> dict:
    """``dtbench run`` of suites/gpu-smoke.yaml in a child process (the real Pythia shapes; ``--small`` or a CPU: the
    tiny shapes, float32, T = 12) into OUT/smoke.db, then ``dtbench report --format json``: each cell's status and
    lossless verdicts. Passes when every cell is done and no lossless decoder's sample failed its check."""
    import subprocess

    import yaml

    suite = yaml.safe_load((tests_dir().parent / "suites" / "gpu-smoke.yaml").read_text(encoding="utf-8"))
    suite["calibrate"] = True  # the run's own curves: its cells predicted from them (issue 48, predict_smoke)
    if small or device.type != "cuda":
        suite.update(
            device=device.type,
            target={"model": "random:tiny:0", "dtype": "float32"},
            draft={"model": "random:tiny-draft:1", "dtype": "float32"},
            generation_lengths=[12],
        )
        suite["datasets"][0].update(prompts=2, L_max=24, params={"vocab": 512, "documents": 4, "length": 64})
    path, dbfile = out_dir / "smoke.yaml", out_dir / "smoke.db"
    path.write_text(yaml.safe_dump(suite), encoding="utf-8")
    dbfile.unlink(missing_ok=True)
    base = [sys.executable, "-P", "-m", "dtbench.cli.main"]
    run = subprocess.run(
        [*base, "run", str(path), "--db", str(dbfile), "--no-progress"], capture_output=True, text=True
    )
    (out_dir / "smoke.log").write_text(run.stdout + run.stderr, encoding="utf-8")
    shown = subprocess.run([*base, "report", "--db", str(dbfile), "--format", "json"], capture_output=True, text=True)
    if shown.returncode != 0:
        return {"ok": False, "error": f"dtbench run exited {run.returncode}: {(run.stdout + run.stderr)[-500:]}"}
    cells = [
        {k: c.get(k) for k in ("label", "status", "n", "lossless", "throughput_mean", "error")}
        for c in json.loads(shown.stdout)["cells"]
    ]
    log(f"smoke: dtbench run exited {run.returncode}; " + ", ".join(f"{c['label']} {c['status']}" for c in cells))
    prediction = predict_smoke(base, dbfile, out_dir)
    log(
        f"smoke predicted from its own curves: speedup MAE {prediction.get('speedup_mae')} {prediction.get('error', '')}"
    )
    return {
        "prediction": prediction,
        "ok": run.returncode == 0 and all(c["status"] == "done" for c in cells) and bool(cells),
        "suite": suite["name"],
        "target": suite["target"]["model"],
        "draft": suite["draft"]["model"],
        "run_exit_code": run.returncode,
        "cells": cells,
        "note": "smoke test: random tokens and random weights say nothing about acceptance or speedup",
    }


def write_paper_curves(result: dict, out_dir: Path, log) -> None:
    """OUT/curves-paper.json (issue 48): the ``costmodel`` step's curves at the paper's shapes and caps, with the
    ``overhead`` step's loop overhead per iteration per decoder (eager), as a portable curves file for ``dtbench
    report --predict-on`` on a run of the real Pythia pair made elsewhere. Written when the costmodel step has
    points; its path goes into ``result["curves_files"]``."""
    from dtbench.harness.calibration import curves_file

    steps, models = result["steps"], result.get("models") or {}
    points = (steps.get("costmodel") or {}).get("points")
    if not points or not models.get("target_shape"):
        return
    overhead = {
        r["decoder"]: r["overhead_s_per_iter"]
        for r in (steps.get("overhead") or {}).get("rows", [])
        if r.get("overhead_s_per_iter") is not None
        # per decoder name, as predict looks it up: the default (host-driven) rows, not the resident tree rows
        and (r.get("params") or {}).get("resident", "off") == "off"
    }
    if overhead:
        overhead["*"] = statistics.median(overhead.values())
    env = result["environment"]
    doc = curves_file.document(
        points,
        device=str(env.get("device")),
        device_name=str(env.get("device_name")),
        models={
            role: {
                "model": f"random:{role}",
                "dtype": models.get("dtype"),
                "params": models.get(f"{role}_parameters"),
                "shape": models.get(f"{role}_shape"),
            }
            for role in ("target", "draft")
        },
        overhead_s=overhead,
        versions={k: str(env[k]) for k in ("torch", "transformers", "dtbench") if env.get(k)},
        source=f"gpu-check costmodel step on {env.get('device_name')}",
    )
    written = curves_file.write(out_dir / "curves-paper.json", doc)
    result.setdefault("curves_files", {})["paper"] = str(written)
    log(f"wrote {written} (the paper's shapes; overhead per iteration for {len(overhead)} decoders)")


def predict_smoke(base: list[str], dbfile: Path, out_dir: Path) -> dict:
    """Validation of the timing half (issue 48 item 3a): the smoke run's own calibration exported as a curves file
    (OUT/curves.json) and the smoke cells predicted from it with ``dtbench report --predict-on``, beside the
    measured speedups; the mean absolute speedup error over the non-AR cells."""
    import subprocess

    curves = out_dir / "curves.json"
    exported = subprocess.run(
        [*base, "report", "--db", str(dbfile), "--export-curves", str(curves)], capture_output=True, text=True
    )
    if exported.returncode != 0:
        return {"ok": False, "error": (exported.stdout + exported.stderr)[-300:]}
    shown = subprocess.run(
        [*base, "report", "--db", str(dbfile), "--predict-on", str(curves), "--format", "json"],
        capture_output=True,
        text=True,
    )
    if shown.returncode != 0:
        return {"ok": False, "curves": str(curves), "error": (shown.stdout + shown.stderr)[-300:]}
    cells = [
        {k: c.get(k) for k in ("label", "predicted_speedup", "measured_speedup", "predicted_throughput")}
        | {"measured_throughput": c.get("measured_throughput")}
        for c in json.loads(shown.stdout)["cells"]
    ]
    errors = [
        abs(c["predicted_speedup"] - c["measured_speedup"])
        for c in cells
        if c["measured_speedup"] and abs(c["measured_speedup"] - 1.0) > 1e-12
    ]
    return {
        "ok": bool(cells),
        "curves": str(curves),
        "cells": cells,
        "speedup_mae": statistics.fmean(errors) if errors else None,
    }
