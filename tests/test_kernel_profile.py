"""The GPU check's forward profile (issue 46 item 3; harness/measurement/kernel_profile.py), on the CPU: host ops are listed with
their time and share, per call; the device fields stay empty off CUDA."""

from __future__ import annotations

import pytest
import torch

from dtbench.harness.measurement.kernel_profile import profile_call
from dtbench.testing.fixtures import tiny_model

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_forward_profile_lists_its_ops_per_call():
    model = tiny_model("llama", 0)
    ids = torch.tensor([[5, 6, 7, 8]])
    calls = []

    def forward():
        calls.append(1)
        with torch.inference_mode():
            model(input_ids=ids)

    summary = profile_call(forward, torch.device("cpu"), warmup=1, repeats=2, top=5)
    assert len(calls) == 3  # one warmup, two profiled
    ops = summary["top_host_ops"]
    assert 0 < len(ops) <= 5 and all(op["seconds"] >= 0 and 0 <= op["share"] <= 1 for op in ops)
    assert any("mm" in op["name"] or "linear" in op["name"] for op in ops)  # the projections are there
    assert sorted((op["seconds"] for op in ops), reverse=True) == [op["seconds"] for op in ops]
    assert summary["device_busy_s"] is None and summary["top_kernels"] == [] and summary["wall_s"] > 0
