"""Portable calibration curves (issue 48): one device's forward-latency curves in a JSON file, with the device, the
versions and the model shapes they were measured at, so a run made elsewhere can be priced on that device
(``dtbench report --predict-on CURVES``).

Acceptance is a property of the model pair and the text, measured on any machine that runs the real models; the
cost of a forward is a property of the device, the shapes and the dtype, measurable with random weights. The file
carries the second to where the first was measured. Written by ``dtbench calibrate --export``, ``dtbench report
--export-curves`` (a calibrated run: its curves and the loop overhead per iteration its cells measured) and the
GPU check (its ``costmodel`` step, the ``overhead`` step's per-iteration overhead added).

Format (``format: dtbench-curves``, ``version: 1``)::

    {"format": "dtbench-curves", "version": 1, "device": "cuda:0", "device_name": "NVIDIA H200",
     "execution": "eager", "source": "...", "versions": {"torch": ..., "transformers": ..., "dtbench": ...},
     "models": {"target": {"model", "dtype", "params", "shape": {...}}, "draft": {...}},
     "overhead_s": {"*": s, "linear": s, ...},          # loop overhead per iteration, seconds (may be empty)
     "rows": [{"role", "cache_len", "n", "tree_mask", "last_only", "rows", "median_s"}, ...]}

Torch-free: reading a file needs no model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dtbench.core import read_regular_file
from dtbench.harness.calibration.curves import Curves
from dtbench.harness.errors import DtbenchError, clip

FORMAT, VERSION = "dtbench-curves", 1
MAX_BYTES = 64 << 20  # the largest curves file read (a real one is a few hundred KB): /dev/zero is refused
ROLES = ("target", "draft")  # the roles a curves row prices (issue 59 item 4: anything else is refused)
# What makes two models cost the same per forward: the architecture's shape (weights may differ: random vs real).
SHAPE_KEYS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
ROW_KEYS = ("role", "cache_len", "n", "tree_mask", "last_only", "rows", "median_s")


def model_shape(config: Any) -> dict[str, Any]:
    """The shape of a transformers model config (:data:`SHAPE_KEYS`; a key the config lacks is left out): what a
    forward's cost depends on besides the dtype and the device. ``num_key_value_heads`` defaults to the head count."""
    out = {k: getattr(config, k) for k in SHAPE_KEYS if getattr(config, k, None) is not None}
    if "num_key_value_heads" not in out and "num_attention_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]
    return out


@dataclass
class PortableCurves:
    """A curves file read back: the curves as a cost function and what they were measured on.

    Attributes:
        curves: the forward-latency curves (:class:`~dtbench.harness.calibration.curves.Curves`, seconds).
        device, device_name: where they were measured (``cuda:0``, ``NVIDIA H200``).
        execution: ``eager`` or ``compiled``: the execution the forwards ran in.
        models: per role (``target``, ``draft``) ``{"model", "dtype", "params", "shape"}``.
        overhead_s: loop overhead per iteration in seconds, per decoder name, ``"*"`` for any other (empty: none
            measured; the prediction then prices forwards only, and says so).
        versions: ``torch``, ``transformers``, ``dtbench`` versions of the measuring machine.
        source: where the file came from, free text.
    """

    curves: Curves
    device: str
    device_name: str
    execution: str
    models: dict[str, dict[str, Any]]
    overhead_s: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    source: str = ""
    path: str = ""

    def overhead(self, decoder: str) -> float | None:
        """Seconds of loop overhead per iteration for ``decoder`` (its own, else ``"*"``), None when none."""
        value = self.overhead_s.get(decoder, self.overhead_s.get("*"))
        return None if value is None else float(value)


def document(
    rows: list[Any],
    *,
    device: str,
    device_name: str,
    models: dict[str, dict[str, Any] | None],
    execution: str = "eager",
    overhead_s: dict[str, float] | None = None,
    versions: dict[str, str] | None = None,
    source: str = "",
) -> dict[str, Any]:
    """The JSON document of a curves file. ``rows``: calibration points as objects or dicts with
    :data:`ROW_KEYS` (``rows`` may be missing: one sequence); ``models``: per role the model entry (None: no such
    role)."""

    def get(r: Any, key: str) -> Any:
        return r.get(key) if isinstance(r, dict) else getattr(r, key, None)

    out_rows = [
        {
            "role": str(get(r, "role")),
            "cache_len": int(get(r, "cache_len")),
            "n": int(get(r, "n")),
            "tree_mask": bool(get(r, "tree_mask")),
            "last_only": bool(get(r, "last_only")),
            "rows": int(get(r, "rows") or 1),
            "median_s": float(get(r, "median_s")),
        }
        for r in rows
    ]
    return {
        "format": FORMAT,
        "version": VERSION,
        "device": device,
        "device_name": device_name,
        "execution": execution,
        "source": source,
        "versions": dict(versions or {}),
        "models": {role: dict(m) for role, m in models.items() if m},
        "overhead_s": {k: float(v) for k, v in (overhead_s or {}).items()},
        "rows": out_rows,
    }


def write(path: str | Path, doc: dict[str, Any]) -> Path:
    """Write ``doc`` (:func:`document`) to ``path`` as JSON; the path written.

    Raises:
        DtbenchError: the file cannot be written (one line).
    """
    p = Path(path)
    try:
        p.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    except OSError as exc:
        raise DtbenchError(f"cannot write the curves file {p}: {exc.strerror or exc}") from None
    return p


def read(path: str | Path) -> PortableCurves:
    """Read a curves file written by :func:`write`, validated completely (issue 59 item 4): every row's fields in
    range (:func:`check_row`), target rows present.

    Raises:
        DtbenchError: not a regular file or larger than :data:`MAX_BYTES` (``/dev/zero``), unreadable, not JSON, not a
            dtbench curves file, a newer version, no target rows or no target model, or a row out of range (one line
            naming the file and the row).
    """
    p = Path(path)
    raw = read_regular_file(p, MAX_BYTES, "curves file")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        raise DtbenchError(f"{p} is not a curves file (not JSON: {clip(exc, 120)})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise DtbenchError(f"{p} is not a dtbench curves file (no 'format: {FORMAT}')")
    if not isinstance(doc.get("version"), int) or doc["version"] > VERSION:
        raise DtbenchError(f"{p} is a curves file of version {doc.get('version')!r}; this dtbench reads {VERSION}")
    rows = doc.get("rows")
    if not isinstance(rows, list) or not rows:
        raise DtbenchError(f"{p} holds no calibration rows")
    points = [SimpleNamespace(**check_row(p, i, r)) for i, r in enumerate(rows)]
    if not any(r.role == "target" for r in points):
        raise DtbenchError(f"{p} holds no target rows: a prediction prices the target's forwards on them")
    models = doc.get("models") or {}
    if not isinstance(models, dict) or not isinstance(models.get("target"), dict):
        raise DtbenchError(f"{p} names no target model")
    overhead = doc.get("overhead_s") or {}
    if not isinstance(overhead, dict) or not all(_seconds(v, zero=True) for v in overhead.values()):
        raise DtbenchError(f"{p}: overhead_s must map decoder names to seconds >= 0")
    return PortableCurves(
        curves=Curves(points),
        device=str(doc.get("device", "?")),
        device_name=str(doc.get("device_name", "?")),
        execution=str(doc.get("execution", "eager")),
        models=models,
        overhead_s=overhead,
        versions=doc.get("versions") or {},
        source=str(doc.get("source", "")),
        path=str(p),
    )


def _seconds(value: Any, zero: bool = False) -> bool:
    """Whether ``value`` is a finite number of seconds > 0 (>= 0 with ``zero``), not a bool."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return value >= 0 if zero else value > 0


def _whole(value: Any, least: int) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def check_row(path: Path, i: int, row: Any) -> dict[str, Any]:
    """Row ``i`` of a curves file checked field by field (issue 59 item 4): ``role`` target or draft (``oracle`` or
    any other refused), ``n`` an integer > 0 (tokens fed), ``cache_len`` an integer >= 0 (cached positions),
    ``rows`` an integer >= 1 (batch rows), ``tree_mask`` and ``last_only`` booleans, ``median_s`` seconds > 0.

    Returns:
        the row's :data:`ROW_KEYS` values.

    Raises:
        DtbenchError: the first field out of range, one line naming the file, the row and the field.
    """
    if not isinstance(row, dict) or any(k not in row for k in ROW_KEYS):
        raise DtbenchError(f"{path}: row {i} lacks one of {', '.join(ROW_KEYS)}")
    problems = {
        "role": (row["role"] in ROLES, f"not one of {', '.join(ROLES)}"),
        "n": (_whole(row["n"], 1), "not an integer > 0 (tokens fed)"),
        "cache_len": (_whole(row["cache_len"], 0), "not an integer >= 0 (cached positions)"),
        "rows": (_whole(row["rows"], 1), "not an integer >= 1 (batch rows)"),
        "tree_mask": (isinstance(row["tree_mask"], bool), "not true or false"),
        "last_only": (isinstance(row["last_only"], bool), "not true or false"),
        "median_s": (_seconds(row["median_s"]), "not a positive number of seconds"),
    }
    for key, (ok, why) in problems.items():
        if not ok:
            raise DtbenchError(f"{path}: row {i} has {key} {clip(repr(row[key]), 60)}, {why}")
    return {k: row[k] for k in ROW_KEYS}


def describe(model: dict[str, Any]) -> str:
    """A model entry in a few words: ``gpt_neox 32 layers x 2560, 2.78e+09 params, float16``."""
    shape = model.get("shape") or {}
    words = []
    if shape:
        words.append(
            f"{shape.get('model_type', '?')} {shape.get('num_hidden_layers', '?')} layers x {shape.get('hidden_size', '?')}"
        )
    if model.get("params"):
        words.append(f"{float(model['params']):.3g} params")
    if model.get("dtype"):
        words.append(str(model["dtype"]))
    return ", ".join(words) or str(model.get("model", "?"))


def shape_mismatch(priced: dict[str, dict[str, Any]], run_models: dict[str, dict[str, Any] | None]) -> str | None:
    """Why the curves cannot price a run's models, None when they can: for each role the run has, the curves must
    hold that role with the same shape (:func:`model_shape`; runs stored before shapes were recorded: the same
    parameter count). The dtype may differ (the curves price their own, and the prediction says which)."""
    for role, ours in run_models.items():
        if not ours:
            continue
        theirs = priced.get(role)
        if theirs is None:
            return f"the curves have no {role} model; the run's {role} is {describe(ours)}"
        a, b = theirs.get("shape"), ours.get("shape")
        if a and b:
            same = all(a.get(k) == b.get(k) for k in set(a) | set(b))
        elif theirs.get("params") and ours.get("params"):
            same = int(theirs["params"]) == int(ours["params"])
        else:
            return f"cannot tell the {role}'s shape (no shape or parameter count recorded on one side)"
        if not same:
            return (
                f"the curves priced the {role} as {describe(theirs)}; the run's {role} is {describe(ours)}: "
                "a prediction across model shapes is refused"
            )
    return None
