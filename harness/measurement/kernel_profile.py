"""Where one forward's time goes (issue 46 item 3): a ``torch.profiler`` summary of a callable, kernel by kernel.

The GPU check profiles one compiled and one eager target forward at n = 1 (``gpucheck`` compiled step) and stores
this summary, so a compiled forward far from its memory-bandwidth limit can be read without a GPU at hand: which
kernels ran and for how long, how much of the forward's span the device was busy (the rest is launch gaps: host
work between kernels, the cost CUDA graphs remove), and the host-side ops (the mask construction and copies around
the compiled region). On a CPU only the host ops are recorded (every op runs on the host); the summary says so.

Built on ``torch.profiler.profile`` and its ``key_averages``/``events`` (PyTorch's documented profiler API; the
approach of gpt-fast's ``--profile`` trace and vLLM's ``benchmarks/kernels`` summaries, without their Chrome traces).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dtbench.harness.measurement.forwards import ForwardTimer, StopRule

__all__ = ["profile_call"]


def profile_call(
    fn: Callable[[], Any], device: torch.device, *, warmup: int = 2, repeats: int = 3, top: int = 12
) -> dict:
    """Profile ``repeats`` calls of ``fn`` (after ``warmup`` unprofiled calls) and summarise them per call.

    Args:
        fn: the work to profile (one forward), taking no arguments.
        device: where it runs; on CUDA the device's kernels are recorded and synchronised around each call.
        warmup, repeats: unprofiled and profiled calls; top: kernels (or host ops) listed.

    Returns:
        A JSON-ready dict: ``device_busy_s`` (kernel time per call, seconds; None off CUDA), ``span_s`` (first kernel
        start to last kernel end per call, seconds; None off CUDA), ``busy_share`` (busy / span: 1 - the launch gaps'
        share), ``kernels_per_call``, ``top_kernels`` ([{name, calls per call, seconds per call, share}], by device
        time), ``top_host_ops`` (the same for host-side ops, by self CPU time), ``wall_s`` (profiled seconds per call by the
        forward timer, the profiler's own overhead included: compare within one summary only).

    Raises:
        Whatever ``fn`` raises.
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    timer = ForwardTimer(device)  # the one forward timer (CUDA events on a GPU), one session of `repeats` calls
    with profile(activities=activities) as prof:
        wall = timer.session(fn, StopRule(min_repeats=repeats), synchronize=False).mean
    averages = prof.key_averages()
    host = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
    host_total = sum(e.self_cpu_time_total for e in averages) or 1.0
    out: dict[str, Any] = {
        "device": device.type,
        "repeats": repeats,
        "wall_s": wall,
        "top_host_ops": [
            {
                "name": e.key[:120],
                "calls": e.count / repeats,
                "seconds": e.self_cpu_time_total / 1e6 / repeats,
                "share": e.self_cpu_time_total / host_total,
            }
            for e in host[:top]
        ],
        "device_busy_s": None,
        "span_s": None,
        "busy_share": None,
        "kernels_per_call": None,
        "top_kernels": [],
    }
    if cuda:
        out.update(_device_summary(prof, repeats, top))
    return out


def _device_summary(prof: Any, repeats: int, top: int) -> dict[str, Any]:
    """Kernel time, span and the top kernels of a CUDA profile (``FunctionEvent`` device-side events)."""
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return {"kernels_per_call": 0}
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1e6
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:120], []).append(e.time_range.elapsed_us() / 1e6)
    ranked = sorted(by_name.items(), key=lambda kv: sum(kv[1]), reverse=True)
    return {
        "device_busy_s": busy / repeats,
        "span_s": span / repeats,  # across the calls, so it includes the syncs between them: an upper bound
        "busy_share": busy / span if span > 0 else None,
        "kernels_per_call": len(kernels) / repeats,
        "top_kernels": [
            {"name": name, "calls": len(t) / repeats, "seconds": sum(t) / repeats, "share": sum(t) / busy}
            for name, t in ranked[:top]
        ],
    }
