"""Memory trackers and hardware flags on a CPU-only machine: NVML and ``torch.cuda`` are replaced by fakes.

The fakes model the situations that matter: ``CUDA_VISIBLE_DEVICES`` remapping (torch's device 0 is NVML's
physical device 1), NVML listing or not listing this process, and readings that fail.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from dtbench.harness.measurement import machine, memory

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

MIB = 2**20
CUDA0 = torch.device("cuda", 0)


class FakeNvml(types.ModuleType):
    """Two physical GPUs; ``used`` and ``procs`` per UUID; index lookups give the physical GPU."""

    def __init__(self, procs_on_b=None, fail_memory=False):
        super().__init__("pynvml")
        self.gpus = {
            "GPU-aaaa": {"used": 9000 * MIB, "procs": []},
            "GPU-bbbb": {"used": 5000 * MIB, "procs": procs_on_b if procs_on_b is not None else []},
        }
        self.fail_memory = fail_memory
        self.uuid_lookups: list[str] = []

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        return list(self.gpus)[index]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.uuid_lookups.append(uuid)
        if uuid not in self.gpus:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return uuid

    def nvmlDeviceGetMemoryInfo(self, handle):
        if self.fail_memory:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return types.SimpleNamespace(used=self.gpus[handle]["used"], total=80 * 1024 * MIB)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return self.gpus[handle]["procs"]


@pytest.fixture()
def fake_cuda(monkeypatch):
    """torch.cuda as a process with CUDA_VISIBLE_DEVICES=1 sees it: its device 0 is physical GPU 1 (UUID bbbb)."""
    calls: list[str] = []
    monkeypatch.setattr(memory, "_NVML_READY", None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="bbbb"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append("reset_peak"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 321 * MIB)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    return calls


def use_nvml(monkeypatch, nvml: FakeNvml) -> FakeNvml:
    monkeypatch.setitem(__import__("sys").modules, "pynvml", nvml)
    return nvml


def track(device=CUDA0, body=lambda: None):
    with memory.MemoryTracker(device) as mem:
        body()
    return mem.peak


def test_nvml_device_is_looked_up_by_uuid_not_cuda_index(monkeypatch, fake_cuda):
    nvml = use_nvml(monkeypatch, FakeNvml())
    peak = track()
    assert nvml.uuid_lookups == ["GPU-bbbb"]
    assert peak.nvml_bytes == 5000 * MIB  # GPU bbbb, not index 0's 9000 MiB
    assert peak.allocated_bytes == 321 * MIB


def test_nvml_reports_this_process_when_nvml_lists_it(monkeypatch, fake_cuda):
    procs = [
        types.SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=4000 * MIB),
        types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=700 * MIB),
    ]
    use_nvml(monkeypatch, FakeNvml(procs_on_b=procs))
    peak = track()
    assert (peak.nvml_bytes, peak.nvml_scope) == (700 * MIB, "process")


@pytest.mark.parametrize(
    "procs",
    [[], [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=None)]],
    ids=["pid not listed", "per-process figure not available"],
)
def test_nvml_falls_back_to_device_memory_and_says_so(monkeypatch, fake_cuda, procs):
    use_nvml(monkeypatch, FakeNvml(procs_on_b=procs))
    peak = track()
    assert (peak.nvml_bytes, peak.nvml_scope) == (5000 * MIB, "device")


def test_failed_nvml_read_is_none_not_zero(monkeypatch, fake_cuda):
    use_nvml(monkeypatch, FakeNvml(fail_memory=True))
    peak = track()
    assert peak.nvml_bytes is None and peak.nvml_scope is None
    assert peak.allocated_bytes == 321 * MIB


def test_read_failing_during_the_sample_is_none(monkeypatch, fake_cuda):
    nvml = use_nvml(monkeypatch, FakeNvml())
    peak = track(body=lambda: setattr(nvml, "fail_memory", True))
    assert peak.nvml_bytes is None and peak.nvml_scope is None


def test_unknown_uuid_gives_no_nvml_reading_rather_than_another_gpu(monkeypatch, fake_cuda):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="cccc"))
    use_nvml(monkeypatch, FakeNvml())
    peak = track()
    assert peak.nvml_bytes is None and peak.nvml_scope is None


def test_no_pynvml_module_is_fine(monkeypatch, fake_cuda):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # import raises ImportError
    peak = track()
    assert peak.nvml_bytes is None and peak.nvml_scope is None and peak.allocated_bytes == 321 * MIB


def test_allocator_cache_is_emptied_and_peak_reset_before_each_sample(monkeypatch, fake_cuda):
    use_nvml(monkeypatch, FakeNvml())
    track(body=lambda: fake_cuda.append("sample"))
    track(body=lambda: fake_cuda.append("sample"))
    assert fake_cuda == ["empty_cache", "reset_peak", "sample"] * 2


def test_cpu_tracker_never_touches_cuda_or_nvml(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("CUDA touched on CPU")

    for name in ("empty_cache", "reset_peak_memory_stats", "max_memory_allocated", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, boom)
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)
    peak = track(torch.device("cpu"), lambda: bytearray(8 * MIB))
    assert peak.rss_bytes and peak.rss_bytes > 8 * MIB
    assert (peak.allocated_bytes, peak.nvml_bytes, peak.nvml_scope) == (None, None, None)


def test_poller_returns_none_when_every_read_fails():
    def read():
        raise OSError("gone")

    p = memory._Poller(read)
    p.start()
    assert p.stop() is None


# --- hardware flags ----------------------------------------------------------------------------------------------


def test_hardware_flags_from_cpuinfo(monkeypatch, tmp_path, fake_cuda):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 9654\n"
        "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512vl\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    )
    monkeypatch.setattr(machine, "_CPUINFO", info)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    hw = machine.hardware_flags(torch.device("cpu"))
    assert hw == {
        "cpu_flags": {
            "avx2": True,
            "avx512f": True,
            "avx512_bf16": True,
            "avx512_fp16": False,
            "amx_bf16": False,
            "amx_tile": False,
        },
        "torch_cpu_capability": "AVX512",
    }
    assert machine.hardware_flags(CUDA0)["cuda_capability"] == "9.0" and machine.hardware_flags(CUDA0)["cuda_bf16"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert machine.hardware_flags(CUDA0)["cuda_bf16"] is False


def test_hardware_flags_without_cpuinfo_or_cuda(monkeypatch, tmp_path):
    monkeypatch.setattr(machine, "_CPUINFO", tmp_path / "missing")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (_ for _ in ()).throw(RuntimeError("no GPU")))
    hw = machine.hardware_flags(torch.device("cpu"))
    assert hw["cpu_flags"] is None and "cuda_capability" not in hw
    hw = machine.hardware_flags(CUDA0)
    assert hw["cuda_capability"] is None and hw["cuda_bf16"] is None


def test_hardware_flags_on_this_machine_is_json_ready():
    import json

    hw = machine.hardware_flags(torch.device("cpu"))
    assert json.loads(json.dumps(hw)) == hw and set(hw) == {"cpu_flags", "torch_cpu_capability"}
