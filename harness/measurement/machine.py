"""The machine a run measures on, recorded with every run so results stay interpretable: versions, device and CPU
names, and the hardware features that decide how fast a dtype runs (CPU AVX-512/AMX flags, CUDA compute capability).
"""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import torch


def device_name(device: torch.device) -> str:
    """A human-readable name of the device (GPU model, or CPU model and core count)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({psutil.cpu_count(logical=True)} threads, torch {torch.get_num_threads()} threads)"


def cpu_model() -> str:
    """The CPU model string from /proc/cpuinfo, or the platform's processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass

    return platform.processor() or "unknown CPU"


# /proc/cpuinfo flags that decide how fast a dtype runs on CPU: AVX2/AVX-512 vector width, native bf16 and fp16
# arithmetic (AVX-512 BF16/FP16) and Intel AMX tiles (oneDNN's bf16 matmuls). Without avx512_bf16/amx_bf16 a
# bfloat16 model is converted on the fly and can be slower than float32 (docs/architecture.md, "The embedded default").
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


_CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo_flags() -> set[str] | None:
    """The CPU's feature flags (the first ``flags`` line of /proc/cpuinfo), or None where unreadable."""
    try:
        for line in _CPUINFO.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def hardware_flags(device: torch.device) -> dict[str, Any]:
    """The hardware features that decide dtype speed, for the run's environment record (``environment["hardware"]``).

    Returns:
        ``cpu_flags``: ``{flag: bool}`` for each of :data:`CPU_FLAGS` from ``/proc/cpuinfo`` (None where that file
        is unreadable, e.g. not Linux); ``torch_cpu_capability``: the SIMD level torch's CPU kernels dispatch to
        (``torch.backends.cpu.get_cpu_capability()``: "DEFAULT", "AVX2", "AVX512", ...; None if unavailable); on
        CUDA also ``cuda_capability`` ("9.0": ``torch.cuda.get_device_capability``) and ``cuda_bf16`` (compute
        capability >= 8.0, i.e. native bfloat16 tensor cores; older GPUs only emulate it). Never raises.
    """
    flags = _cpuinfo_flags()
    out: dict[str, Any] = {"cpu_flags": None if flags is None else {f: f in flags for f in CPU_FLAGS}}
    try:
        out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:
        out["torch_cpu_capability"] = None
    if device.type == "cuda":
        try:
            major, minor = torch.cuda.get_device_capability(device)
            out["cuda_capability"], out["cuda_bf16"] = f"{major}.{minor}", major >= 8
        except Exception:
            out["cuda_capability"], out["cuda_bf16"] = None, None
    return out


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and hardware of this run, stored with it so results stay interpretable."""

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    env = {
        "dtbench": version("dtbench"),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": device_name(device),
        "cpu": cpu_model(),
        "hardware": hardware_flags(device),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "git_sha": _git_sha(),
    }
    return env


def _git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None
