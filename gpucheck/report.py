"""The check's environment (versions, the device) and the summary its JSON closes with."""

from __future__ import annotations

import platform
from typing import Any


def environment(device) -> dict:
    """Versions and the device the check ran on."""
    import torch

    from dtbench.harness.measurement.machine import device_name

    def version(dist: str) -> str | None:
        from importlib import metadata

        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "device_name": device_name(device),
        "host": platform.node(),
        "torch_file": torch.__file__,
    }
    for dist in ("dtbench", "transformers", "sqlalchemy", "pydantic", "zeus", "nvidia-ml-py", "numpy"):
        env[dist] = version(dist)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu_memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count)
    return env


def summary(result: dict) -> dict:
    """The lines a closing note quotes: lossless verdicts, predicted vs paper speedups, loop overhead."""
    steps = result["steps"]
    out: dict[str, Any] = {}
    if "lossless" in steps and "rows" in steps["lossless"]:
        rows = steps["lossless"]["rows"]
        out["lossless"] = {
            "rows": len(rows),
            "passed": sum(r["ok"] for r in rows),
            "failed": [f"{r['arch']} {r['dtype']} {r['decoder']}" for r in rows if not r["ok"]],
            "ties": sum(r.get("ties") or 0 for r in rows),
        }
    if "costmodel" in steps and "predictions" in steps["costmodel"]:
        out["speedups"] = [
            {
                "method": p["method"],
                "dataset": p["dataset"],
                "paper": p["paper_speedup"],
                "predicted": p.get("predicted_speedup", p.get("predicted_speedup_range")),
                **(
                    {
                        "nodes_range": p["nodes_range"],
                        "nodes_implied_by_paper": p["nodes_implied_by_paper"],
                        "paper_inside_range": p["paper_inside_range"],
                    }
                    if "nodes_range" in p
                    else {}
                ),
            }
            for p in steps["costmodel"]["predictions"]
        ]
    if "overhead" in steps and "rows" in steps["overhead"]:
        out["overhead_ms_per_iter"] = {
            _row_name(r): (None if r.get("overhead_s_per_iter") is None else round(r["overhead_s_per_iter"] * 1e3, 3))
            for r in steps["overhead"]["rows"]
        }
        out["host_reads_per_iter_max"] = {  # issue 46 item 1: at most 1 is the target
            _row_name(r): (r.get("host_reads_per_iter_max"), r.get("cuda_syncs_per_iter_max"))
            for r in steps["overhead"]["rows"]
        }
    if "compiled" in steps and "forwards" in steps["compiled"]:
        c = steps["compiled"]
        out["compiled"] = {
            "compile_s": round(c["compile_s"], 1),
            "forward_ms": {
                str(f["n"]): [round(f["eager_s"] * 1e3, 3), round(f["compiled_s"] * 1e3, 3)] for f in c["forwards"]
            },
            "ar_tokens_per_s": {k: round(v["tokens_per_s"], 1) for k, v in c["ar"].items()},
            "ar_roofline": {k: v["roofline"] for k, v in c["ar"].items()},
            "overhead_ms_per_iter": {
                f"{_row_name(r)} {r['mode']}": None
                if r.get("overhead_s_per_iter") is None
                else round(r["overhead_s_per_iter"] * 1e3, 3)
                for r in c["overhead"]
            },
        }
    return out


def _row_name(row: dict) -> str:
    """An overhead row's name in the summary: the decoder, and its drafting mode when not the host's (a resident tree
    row beside the host-driven one of the same decoder; a chain drafted in one compiled region: ``fused_draft``)."""
    params = row.get("params") or {}
    resident = params.get("resident")
    name = row["decoder"] if resident in (None, "off") else f"{row['decoder']} resident={resident}"
    return f"{name} fused_draft" if params.get("fused_draft") else name
