"""How far a measurement is from the hardware's limit (issue 37): memory bandwidth, bytes per forward, roofline.

Decoding at batch 1 is memory-bound: every forward reads every weight of its model once, plus the KV cache it attends
to. The *limit* of a sample is the seconds its forwards would take if each did nothing but read those bytes at the
device's memory bandwidth; its **roofline fraction** is that limit over the measured total time (1.0 = at the
limit; eager transformers on a GPU runs near 0.1: launch- and Python-bound, the regime where every extra verified
token looks free). The bandwidth is measured once per run by a copy benchmark on the device (read + write of a
buffer far larger than any cache) and stored with the run's environment; on CUDA the vendor's figure (memory clock
x bus width, NVML) is stored beside it. The limit counts bytes only: a prefill, which is compute-bound, makes the
fraction an upper bound of what is reachable, never an overstatement of the gap.

The forward-latency curves of a calibration say which regime a model's forwards are in
(:func:`forward_regime`): *launch-bound* when one forward takes several times its byte limit and stays flat in the
number of new tokens (kernel launches and Python dominate), *bandwidth-bound* when it is near its byte limit and
flat, *compute-bound* when its cost grows with the tokens fed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

COPY_BYTES = {"cuda": 512 * 2**20, "cpu": 128 * 2**20}  # the copy benchmark's buffer: above any cache, per device
_MEASURED: dict[tuple[str, int], dict[str, Any]] = {}  # once per process and device (every worker of a run reuses it)
LAUNCH_FACTOR = 3.0  # a flat forward this many times its byte limit is launch-bound, not bandwidth-bound
FLAT_GROWTH = 1.5  # cost at the largest calibrated n below this multiple of the cost at n = 1: flat in n


def measure_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> dict[str, Any]:
    """The device's memory bandwidth, bytes/s, by a copy benchmark (best of ``repeats`` copies of ``nbytes``, default
    :data:`COPY_BYTES` of the device's type); measured once per process and device at the default size.

    A copy reads and writes ``nbytes`` each, so the figure is ``2 * nbytes / seconds`` (what STREAM's copy kernel
    reports). On CUDA the device is synchronized around each copy and NVML's theoretical figure (memory clock x bus
    width x 2, double data rate) is added where readable.

    Returns:
        {"bytes_per_s": measured, "vendor_bytes_per_s": NVML's figure or None, "method": a description}.
    """
    key = (str(device), nbytes or 0)
    if nbytes is None and key in _MEASURED:
        return dict(_MEASURED[key])
    size = nbytes or COPY_BYTES.get(device.type, COPY_BYTES["cpu"])
    n = size // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    cuda = device.type == "cuda"
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    out = {
        "bytes_per_s": 2 * n * 4 / best if best > 0 else None,
        "vendor_bytes_per_s": _nvml_bandwidth(device) if cuda else None,
        "method": f"copy of {size // 2**20} MiB, best of {repeats}, read + write counted",
    }
    if nbytes is None:
        _MEASURED[key] = dict(out)
    return out


def _nvml_bandwidth(device: torch.device) -> float | None:
    """NVML's theoretical memory bandwidth of ``device`` in bytes/s, or None where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
            bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
            return float(clock_mhz) * 1e6 * bus_bits / 8 * 2
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def model_bytes(model: Any) -> dict[str, int] | None:
    """The bytes a forward of ``model`` reads besides the KV cache, and the KV bytes per cached position.

    ``weights``: every parameter once (a tied input embedding counted once; an untied one left out, since a forward
    reads only the rows of its tokens). ``kv_per_position``: keys and values of every layer for one position
    (2 x layers x KV heads x head dim x element size).

    Returns:
        {"weights": bytes, "kv_per_position": bytes}, or None for no model.
    """
    if model is None:
        return None
    seen: set[int] = set()
    weights = 0
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = embed.weight if embed is not None and (out is None or out.weight is not embed.weight) else None
    for p in model.parameters():
        if id(p) in seen or p is skip:
            continue
        seen.add(id(p))
        weights += p.numel() * p.element_size()
    cfg = model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = int(getattr(cfg, "num_attention_heads", 1))
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    element = next(model.parameters()).element_size()
    kv = 2 * int(cfg.num_hidden_layers) * kv_heads * head_dim * element
    return {"weights": weights, "kv_per_position": kv}


def limit_seconds(fed: Iterable[Sequence[int | None]], sizes: dict[str, int], bandwidth: float) -> float:
    """Seconds the forwards ``fed`` of one model would take at ``bandwidth`` bytes/s.

    Args:
        fed: per forward ``[n, past, flags]`` (the runner's :class:`~dtbench.harness.measurement.measure.ForwardCounter`
            entries): n new tokens on a cache of ``past`` positions (None: unknown, counted as 0).
        sizes: :func:`model_bytes` of that model.
    """
    total = 0.0
    for entry in fed:
        n, past = int(entry[0] or 0), int(entry[1] or 0)
        total += sizes["weights"] + sizes["kv_per_position"] * (past + n)
    return total / bandwidth


def sample_fraction(
    records: Sequence[Any],
    total_s: float,
    target: dict[str, int] | None,
    draft: dict[str, int] | None,
    bandwidth: float | None,
) -> float | None:
    """A sample's roofline fraction: the limit seconds of all its forwards (target and draft) over ``total_s``.

    Args:
        records: the sample's :class:`~dtbench.harness.measurement.measure.StepRecord` list (its forwards' fed entries).
        total_s: the sample's measured seconds.
        target, draft: :func:`model_bytes` of the target and draft (draft None: its forwards, if any, uncounted).
        bandwidth: bytes/s (None: unknown, no fraction).

    Returns:
        The fraction (> 0), or None where the bandwidth, the sizes or the forwards are unknown.
    """
    if not bandwidth or target is None or total_s <= 0:
        return None
    target_fed = [e for r in records for e in (r.target_fed or [])]
    if not target_fed:
        return None
    limit = limit_seconds(target_fed, target, bandwidth)
    if draft is not None:
        limit += limit_seconds([e for r in records for e in (r.draft_fed or [])], draft, bandwidth)
    return limit / total_s


def forward_regime(curve: dict[int, float], sizes: dict[str, int] | None, bandwidth: float | None) -> str | None:
    """Which regime a model's forwards are in, from a calibrated latency curve {new tokens n: seconds}.

    ``compute-bound``: the cost at the largest n is at least :data:`FLAT_GROWTH` times the cost at n = 1 (it grows
    with the tokens fed); otherwise flat in n, ``launch-bound`` when one forward takes more than
    :data:`LAUNCH_FACTOR` times its byte limit (weights / bandwidth), else ``bandwidth-bound``. Without a bandwidth
    a flat curve is ``flat``.

    Returns:
        The regime's name, or None for a curve without n = 1 and a larger n.
    """
    if 1 not in curve or len(curve) < 2 or curve[1] <= 0:
        return None
    largest = max(curve)
    if curve[largest] >= FLAT_GROWTH * curve[1]:
        return "compute-bound"
    if not bandwidth or sizes is None:
        return "flat"
    limit = sizes["weights"] / bandwidth
    return "launch-bound" if curve[1] > LAUNCH_FACTOR * limit else "bandwidth-bound"
