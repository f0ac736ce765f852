"""The GPU check's command (``python -m dtbench.gpucheck``, ``tools/gpu-check.sh``): options, the device, the log,
and the steps run one after another into OUT/gpu-check.json."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from dtbench.gpucheck import budget as budget_plan
from dtbench.gpucheck import common
from dtbench.gpucheck.children import run_child, run_step
from dtbench.gpucheck.common import SCHEMA, STEPS, utc_now
from dtbench.gpucheck.proptests import step_tests
from dtbench.gpucheck.report import environment, summary
from dtbench.gpucheck.smoke import step_smoke, write_paper_curves


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Folder for gpu-check.json and gpu-check.log (created).",
)
@click.option(
    "--device",
    "device_name",
    default="auto",
    show_default=True,
    help="cuda, cpu, or auto (cuda when torch sees a GPU).",
)
@click.option("--small", is_flag=True, help="Small shapes instead of Pythia-2.8B/70M (the CPU dry run, tests).")
@click.option(
    "--steps", default=",".join(STEPS), show_default=True, help="Comma-separated subset of: " + ", ".join(STEPS) + "."
)
@click.option(
    "--decoders",
    default=None,
    help="Comma-separated decoder names: restrict steps lossless and overhead to them (default: every built-in).",
)
@click.option(
    "--budget",
    type=click.FloatRange(min=1),
    default=None,
    callback=lambda ctx, param, value: _finite(value, "--budget"),
    help="Seconds the whole check may take (a lease: 540). Steps then run most valuable first (tests, compiled, "
    "smoke, lossless, costmodel, overhead, timing); a step whose planned seconds do not fit is skipped and listed.",
)
@click.option(
    "--spent",
    type=click.FloatRange(min=0),
    default=0.0,
    callback=lambda ctx, param, value: _finite(value, "--spent"),
    help="Seconds of the budget already used (the install).",
)
@click.option("--plan", "plan_only", is_flag=True, help="Print the GPU plan against the budget (default 540 s); exit.")
@click.option("--child", default=None, hidden=True)
@click.option("--rows-file", type=click.Path(path_type=Path), default=None, hidden=True)
@click.option("--skip-ids", default="", hidden=True)
def main(
    out_dir: Path,
    device_name: str,
    small: bool,
    steps: str,
    decoders: str | None,
    budget: float | None,
    spent: float,
    plan_only: bool,
    child: str | None,
    rows_file: Path | None,
    skip_ids: str,
) -> None:
    """Run the offline GPU check (issue 31) and write OUT/gpu-check.json (each step in a child process).

    Exit code 0 when every step run passed, 1 when one failed, 2 for bad arguments (click's usage errors)."""
    common.ONLY = None  # every built-in lossless decoder: what an unknown --decoders name is told to choose from
    requested = {d.strip() for d in decoders.split(",") if d.strip()} if decoders else None
    chosen = [s.strip() for s in steps.split(",") if s.strip()]
    bad = [s for s in chosen if s not in STEPS]
    if bad or not chosen:
        raise click.UsageError(
            f"--steps: unknown step {bad[0]!r} (choose from {', '.join(STEPS)})"
            if bad
            else "--steps: name at least one step"
        )
    if requested is not None:  # (issue 67: the hint listed only `ar`, the known set filtered by the request)
        known = {n for n, _ in common.lossless_decoders()} | {"ar"}
        unknown = sorted(requested - known)
        if unknown:
            raise click.UsageError(
                f"--decoders: unknown decoder {', '.join(unknown)} (built-in lossless decoders: {', '.join(sorted(known))})"
            )
    common.ONLY = requested  # set once valid: a refused request leaves no restriction behind
    if plan_only:  # the plan for --device (auto: the node's cuda) and the --steps asked for
        plan_device = "cpu" if device_name == "cpu" else "cuda"
        for line in budget_plan.plan_lines(plan_device, budget or budget_plan.LEASE_BUDGET_S, spent, chosen):
            click.echo(line)
        return
    device = _device(device_name)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = _Log(out_dir / "gpu-check.log", child)
    if child:
        assert rows_file is not None  # run_step passes --rows-file with every --child
        run_child(child, device, small, rows_file, frozenset(filter(None, skip_ids.split(","))), log)
        return
    argv_base = [
        "--out",
        str(out_dir),
        "--device",
        device.type,
        *(["--small"] if small else []),
        *(["--decoders", decoders] if decoders else []),
    ]
    result = _run_steps(chosen, argv_base, device, small, out_dir, budget, spent, log)
    log(json.dumps(result["summary"], default=str))
    sys.exit(0 if result["ok"] else 1)


def _finite(value: float | None, option: str) -> float | None:
    """``value`` unless it is NaN or infinite (click's FloatRange lets NaN through: every comparison with it is
    false, so a NaN budget skipped every step and wrote NaN, which is not JSON)."""
    import math

    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number of seconds", param_hint=option)
    return value


def _device(name: str):
    """The torch device of ``--device`` (auto: cuda when torch sees a GPU).

    Raises:
        click.UsageError: not cuda, cpu or auto; click.ClickException: cuda asked and torch sees no GPU.
    """
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cuda", "cpu"):
        raise click.UsageError(f"--device {name!r}: choose cuda, cpu or auto")
    if name == "cuda" and not torch.cuda.is_available():
        raise click.ClickException(f"--device cuda: torch {torch.__version__} sees no CUDA GPU")
    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


class _Log:
    """``log(line)``: a line stamped with the seconds since the check began (and the child's step) to stdout and
    the log file. ``elapsed()``: those seconds (the wall clock of whole steps, never of a forward)."""

    def __init__(self, path: Path, child: str | None):
        self.began = time.perf_counter()
        self.file = path.open("a", encoding="utf-8")
        self.child = child

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def __call__(self, line: str) -> None:
        stamped = f"[{self.elapsed():7.1f}s]{' ' + self.child if self.child else ''} {line}"
        print(stamped, flush=True)
        self.file.write(stamped + "\n")
        self.file.flush()


def _run_steps(
    chosen: list[str], argv_base: list[str], device, small: bool, out_dir: Path, budget, spent: float, log: _Log
) -> dict[str, Any]:
    """Run the ``chosen`` steps (in the budget's order, a step that no longer fits skipped) and write
    OUT/gpu-check.json after each; returns the result written last."""
    import torch

    result: dict[str, Any] = {
        "schema": SCHEMA,
        "started": utc_now(),
        "small": small,
        "steps_requested": chosen,
        "decoders_requested": sorted(common.ONLY) if common.ONLY else None,
        "environment": environment(device),
        "steps": {},
    }
    path = out_dir / "gpu-check.json"

    def write() -> None:
        result["wall_s"] = log.elapsed()
        result["finished"] = utc_now()
        result["ok"] = all(result["steps"].get(s, {}).get("ok", False) for s in chosen if s not in skipped)
        result["summary"] = summary(result)
        path.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")

    log(
        f"gpu-check on {result['environment']['device_name']} ({device}), torch {torch.__version__}, "
        f"steps {', '.join(chosen)}{' (small shapes)' if small else ''}"
    )
    order, skipped = budget_plan.plan_steps(chosen, device.type, budget, spent)
    result["budget_s"], result["skipped_steps"] = budget, skipped
    if budget is not None:
        for line in budget_plan.plan_lines(device.type, budget, spent, chosen):
            log(line)
    for step in order:
        why = budget_plan.still_fits(step, device.type, budget, spent + log.elapsed())
        if why is not None:
            skipped[step] = why
            log(f"{step}: skipped ({why})")
            continue
        t0 = log.elapsed()
        if step == "tests":
            res, models = step_tests(device, out_dir, log), None
        elif step == "smoke":
            res, models = step_smoke(device, small, out_dir, log), None
        else:
            res, models = run_step(step, argv_base, device, small, out_dir, log)
        if models:
            result["models"] = models
        res["seconds"] = log.elapsed() - t0
        result["steps"][step] = res
        write()
        log(f"{step}: {'ok' if res['ok'] else 'FAILED'} in {res['seconds']:.1f} s")
    write_paper_curves(result, out_dir, log)
    write()
    log(f"wrote {path}: {'ok' if result['ok'] else 'FAILED'} in {result['wall_s']:.1f} s")
    return result
