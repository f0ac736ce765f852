"""Suite files and command-line values (issues 19 and 42): what a user writes is checked at `validate`, and
anything out of range is one error line, never a hang or a traceback: control characters in labels and names,
NaN, infinite and out-of-range floats in options and suites, huge seeds, include fan-out, oversized, deeply nested
or device-file suites, loose (string-typed) values, a batch size above the measured prompts, and the GPU check
script's OUT argument.

Split out of tests/test_hardening.py by subject (issue 57 item 3); each section names the issue item it tests.
Shared helpers: tests/hardening_kit.py.
"""

from __future__ import annotations

import pytest
import yaml
from hardening_kit import database_text, tiny_suite
from kit import invoke, one_line_error, write_suite

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)


# --- issue 19 item 3: control characters in labels and names -------------------------------------------------------

ESC_LABELS = ["red \x1b[31mlabel", "title \x1b]0;pwned\x07", "two\nlines", "bell\x07", "c1 \x9b31m"]


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
@pytest.mark.parametrize("label", ESC_LABELS)
def test_control_characters_in_labels_are_refused(tmp_path, label):
    suite = write_suite(tmp_path, tiny_suite(decoders=[{"name": "ar", "label": label}]))
    line = one_line_error(invoke("validate", suite), "decoders.0.label", "control character")
    assert "\x1b" not in line and "\x07" not in line and "\x9b" not in line


@pytest.mark.parametrize("where", ["name", "dataset", "sweep"])
def test_control_characters_in_names_are_refused(tmp_path, where):
    bad = "x\x1b[2Jy"
    suite = {
        "name": tiny_suite(name=bad),
        "dataset": tiny_suite(datasets=[{"name": bad, "prompts": 2, "warmup": 1}]),
        "sweep": tiny_suite(decoders=[{"name": "ar"}, {"name": "linear", "sweep": {"k": [bad]}}]),
    }[where]
    line = one_line_error(invoke("validate", write_suite(tmp_path, suite)), "control character")
    assert "\x1b" not in line


# --- issue 19 items 5, 8: no NaN, infinity or out-of-range float in options ----------------------------------------


@pytest.mark.parametrize(
    "args, option",
    [
        (["calibrate", "x.yaml", "--min-time", "nan", "--max-time", "nan"], "--min-time"),
        (["calibrate", "x.yaml", "--min-time", "nan"], "--min-time"),
        (["calibrate", "x.yaml", "--max-time", "inf"], "--max-time"),
        (["calibrate", "x.yaml", "--min-time", "0"], "--min-time"),
        (["calibrate", "x.yaml", "--min-time", "-1"], "--min-time"),
        (["report", "--compare", "1", "2", "--fail-if", "throughput:-5%", "--alpha", "nan"], "--alpha"),
        (["report", "--compare", "--alpha", "nan"], "--alpha"),
        (["report", "--compare", "--alpha", "1"], "--alpha"),
        (["run", "x.yaml", "--executor", "ray", "--connect-timeout", "nan"], "--connect-timeout"),
        (["run", "x.yaml", "--executor", "ray", "--connect-timeout", "inf"], "--connect-timeout"),
    ],
)
def test_float_options_refuse_non_finite_and_out_of_range(tmp_path, args, option):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output, result.output
    assert "Traceback" not in result.output


# --- issue 19 items 9, 10, 5: floats and seeds in a suite ----------------------------------------------------------


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"timeout_s": 1e300}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"seed": 340282366920938463463374607431768211456}, "seed"),
        ({"seed": 1 << 63}, "seed"),
        ({"seed": -1}, "seed"),
        ({"sampling": {"seed": 1 << 64}}, "sampling.seed"),
        ({"sampling": {"temperature": float("nan")}}, "sampling.temperature"),
        ({"decoders": [{"name": "ar"}, {"name": "dynatree", "params": {"eta_depth": float("nan")}}]}, "eta_depth"),
    ],
)
def test_suite_numbers_out_of_range_are_one_line_errors(tmp_path, changes, field):
    one_line_error(invoke("validate", write_suite(tmp_path, tiny_suite(**changes))), field)


def test_largest_seed_and_timeout_validate(tmp_path):
    result = invoke("validate", write_suite(tmp_path, tiny_suite(seed=(1 << 63) - 1, timeout_s=30 * 24 * 3600)))
    assert result.exit_code == 0, result.output


# --- issue 19 items 6, 7: include fan-out, size, depth, devices ----------------------------------------------------


def test_include_fan_out_reads_each_file_once(tmp_path, monkeypatch):
    from dtbench.harness.suites import suitefile

    for i in range(5):
        body = {"include": [f"f{i + 1}.yaml"] * 10} if i < 4 else tiny_suite()
        (tmp_path / f"f{i}.yaml").write_text(yaml.safe_dump(body))
    reads = []
    real = suitefile._read
    monkeypatch.setattr(suitefile, "_read", lambda path, *a: reads.append(path) or real(path, *a))
    suite, text = suitefile.load_suite(tmp_path / "f0.yaml")
    assert suite.name == "tiny"
    assert len(reads) == 5, len(reads)  # today's loader read 1 + 10 + 100 + 1000 + 10000 files
    assert text.count("# --- include:") == 4


def test_included_text_is_capped(tmp_path):
    pad = "# " + "x" * 998 + "\n"
    for i in range(3):
        (tmp_path / f"big{i}.yaml").write_text(pad * 400 + "description: big\n")  # 400 kB each, 1.2 MB together
    (tmp_path / "top.yaml").write_text(yaml.safe_dump({**tiny_suite(), "include": [f"big{i}.yaml" for i in range(3)]}))
    one_line_error(invoke("validate", str(tmp_path / "top.yaml")), "include: files hold more than 1,048,576 bytes")


def test_huge_deep_and_device_suites_are_one_line_errors(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: x\nparams: " + "[" * 5000 + "]" * 5000 + "\n")
    one_line_error(invoke("validate", str(deep)), "nests more than 64 levels")
    nested = tmp_path / "nested.yaml"
    nested.write_text(
        yaml.safe_dump({**tiny_suite(), "description": None}).replace(
            "description: null", "x: " + "[" * 100 + "]" * 100
        )
    )
    one_line_error(invoke("validate", str(nested)), "nests more than 64 levels")
    big = tmp_path / "big.yaml"
    big.write_text(yaml.safe_dump(tiny_suite()) + ("# padding\n" * 120_000))
    one_line_error(invoke("validate", str(big)), "larger than 1,048,576 bytes")
    for device in ("/dev/zero", "/dev/urandom"):
        one_line_error(invoke("validate", device), "not a regular file")
    one_line_error(invoke("run", "/dev/urandom", "--db", str(tmp_path / "r.db")), "not a regular file")


def test_text_files_path_of_a_device(tmp_path):
    suite = tiny_suite(datasets=[{"name": "text-files", "path": "/dev/zero", "prompts": 2, "warmup": 1, "L_max": 16}])
    one_line_error(invoke("validate", write_suite(tmp_path, suite)), "/dev/zero is not a regular file")


# --- issue 19, also seen: loose values, CUDA without CUDA, an ignored hub id, a template device --------------------


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"generation_lengths": ["8"]}, "generation_lengths.0"),
        ({"sampling": {"seed": "42"}}, "sampling.seed"),
        ({"name": ""}, "name"),
        ({"decoders": [{"name": "ar", "label": ""}]}, "decoders.0.label"),
        ({"datasets": [{"name": "wikitext-2", "prompts": "2", "warmup": 1}]}, "datasets.0.prompts"),
    ],
)
def test_loose_values_are_refused(tmp_path, changes, field):
    one_line_error(invoke("validate", write_suite(tmp_path, tiny_suite(**changes))), field)


def test_validate_warns_about_cuda_without_cuda(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = invoke("validate", write_suite(tmp_path, tiny_suite(device="cuda")))
    assert "device: cuda and this machine has no CUDA device" in result.stderr, result.output


def test_hub_id_ignored_with_a_data_dir_is_noted(tmp_path, data_dir, capfd):
    from dtbench.harness.data import datasets as data
    from dtbench.harness.suites.suite import DatasetSpec

    spec = DatasetSpec.model_validate({"name": "wikitext-2", "prompts": 2, "warmup": 1, "hub_id": "me/wiki"})
    data.load_documents(spec, str(data_dir))
    assert "note: wikitext-2: hub_id ignored: the local data folder" in capfd.readouterr().err


def test_chat_template_file_of_a_device():
    from dtbench.harness.data import chat
    from dtbench.harness.errors import DtbenchError

    with pytest.raises(DtbenchError, match="not a regular file"):
        chat.template_text("/dev/zero", None, "m")


# --- issue 42 item 7: a batch size larger than the measured prompts ------------------------------------------------


def test_a_batch_size_above_the_measured_prompts_is_refused_at_validate(tmp_path):
    suite = write_suite(
        tmp_path, tiny_suite(datasets=[{"name": "wikitext-2", "prompts": 3, "warmup": 1}], batch_sizes=[1, 4])
    )
    for command in ("validate", "run"):
        result = invoke(command, suite, *(["--db", str(tmp_path / "r.db")] if command == "run" else []))
        one_line_error(
            result, "batch size 4 is larger than its 2 measured prompts (prompts 3 - warmup 1)", "at least 5"
        )
    assert not (tmp_path / "r.db").exists() or 'INSERT INTO "runs"' not in database_text(tmp_path / "r.db")


# --- issue 42 item 8: tools/gpu-check.sh OUT where OUT is a file ---------------------------------------------------


@pytest.mark.parametrize("what", ["file", "under_a_file", "relative"])
def test_gpu_check_sh_out_that_is_a_file_is_one_line(tmp_path, what):
    import subprocess
    import sys
    from pathlib import Path

    target = tmp_path / "taken"
    target.write_text("someone's file\n")
    out = {"file": target, "under_a_file": target / "sub", "relative": Path("taken")}[what]  # relative: the caller's
    env = {"PATH": "/usr/bin:/bin", "GPUKIT": str(tmp_path / "empty"), "PYTHON": sys.executable}
    script = Path(__file__).resolve().parents[1] / "tools" / "gpu-check.sh"
    proc = subprocess.run(["bash", str(script), str(out)], capture_output=True, text=True, env=env, cwd=tmp_path)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert (
        str(tmp_path / out) in lines[0] and "mkdir" not in lines[0] and "tee" not in lines[0] and "see " not in lines[0]
    )
    assert target.read_text() == "someone's file\n"  # untouched
