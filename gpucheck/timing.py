"""Step b, **timing**: the forward timer's CUDA events against the wall clock around synchronized forwards, NVML
against the allocator, energy per token (:func:`step_timing`; the package docstring)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from dtbench.gpucheck.common import build, sync

EVENT_REL_TOL, EVENT_ABS_TOL_S = 0.10, 0.5e-3  # CUDA events vs wall clock (as tests/test_cuda.py)
NVML_OVER_ALLOCATOR = 4 * 2**30  # NVML adds the CUDA context and the allocator's cache: well below this


def step_timing(device, target, log) -> dict:
    """CUDA events vs the wall clock, NVML vs the allocator, energy per token (module docstring, step b)."""
    import torch

    from dtbench.harness.measurement.energy import MEASURED
    from dtbench.harness.measurement.forwards import ForwardTimer
    from dtbench.harness.measurement.measure import ForwardCounter, measure
    from dtbench.harness.measurement.memory import MemoryTracker

    out: dict[str, Any] = {}
    vocab = target.config.vocab_size
    events = []
    wall_clock = ForwardTimer.host(device)  # the host clock around a synchronized forward, against the events
    with torch.inference_mode():
        for n in (1, 64, 512):
            ids = torch.randint(3, vocab, (1, n), device=device, generator=None)
            target(ids)  # warm the kernels of this shape

            def forward_synchronized(ids=ids) -> None:
                target(ids)
                sync(device)

            for _ in range(3):
                with ForwardCounter(target, None) as counter:
                    sync(device)
                    wall = wall_clock.time(forward_synchronized)
                ev = counter.forward_seconds()["target"]
                assert ev is not None  # the counter counts the target
                events.append(
                    {
                        "n": n,
                        "events_s": ev,
                        "wall_s": wall,
                        "ok": ev <= wall + EVENT_ABS_TOL_S and ev >= wall * (1 - EVENT_REL_TOL) - EVENT_ABS_TOL_S,
                    }
                )
    # On a CPU the "events" are the wall clock read inside the hooks: the comparison is shown, not judged (a loaded
    # CPU puts more than 10% of a 1 ms forward outside the hooks).
    out["forward_events_vs_wall"] = {
        "ok": all(e["ok"] for e in events) if device.type == "cuda" else True,
        "source": "cuda events"
        if device.type == "cuda"
        else "wall clock inside the hooks (CPU: informational, not judged)",
        "rel_tol": EVENT_REL_TOL,
        "abs_tol_s": EVENT_ABS_TOL_S,
        "rows": events,
    }
    size = 512 * 2**20 if device.type == "cuda" else 64 * 2**20
    with MemoryTracker(device) as mem:
        block = torch.empty(size, dtype=torch.uint8, device=device)
        block.fill_(1)
        sync(device)
        time.sleep(0.1)  # NVML is polled every 5 ms
        del block
    peak = mem.peak
    if device.type == "cuda":
        ok = (
            peak.allocated_bytes is not None
            and peak.allocated_bytes >= size
            and peak.nvml_bytes is not None
            and peak.nvml_bytes >= peak.allocated_bytes
            and (peak.nvml_scope != "process" or peak.nvml_bytes - peak.allocated_bytes < NVML_OVER_ALLOCATOR)
        )
    else:
        ok = peak.rss_bytes is not None and peak.rss_bytes >= size
    out["memory"] = {
        "ok": bool(ok),
        "block_bytes": size,
        "allocated_bytes": peak.allocated_bytes,
        "nvml_bytes": peak.nvml_bytes,
        "nvml_scope": peak.nvml_scope,
        "rss_bytes": peak.rss_bytes,
    }
    T = 64
    prompt = torch.randint(3, vocab, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    ar = build("ar", {}, target, None, Path(tempfile.gettempdir()))
    measure(ar, prompt, 8, device)  # warmup
    m = measure(ar, prompt, T, device)
    e = m.energy
    energy = {
        "status": e.status if e else "unavailable",
        "source": e.source if e else "no reading",
        "energy_j": e.energy_j if e else None,
        "tokens": T,
        "j_per_token": (e.energy_j / T) if e is not None and e.status == MEASURED and e.energy_j else None,
        "seconds": m.step_times[-1],
    }
    # On a GPU the counter must be readable (NVML, Volta+); on a CPU an unreadable RAPL is normal, not a failure.
    energy["ok"] = energy["j_per_token"] is not None if device.type == "cuda" else True
    out["energy"] = energy
    out["ok"] = out["forward_events_vs_wall"]["ok"] and out["memory"]["ok"] and energy["ok"]
    log(
        f"timing: events {out['forward_events_vs_wall']['ok']}, memory {out['memory']['ok']}, "
        f"energy {energy['status']} {energy['j_per_token']}"
    )
    return out
