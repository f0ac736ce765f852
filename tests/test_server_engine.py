"""The server decoder against a real llama.cpp server (llama-server of the `engine` extra, built from source by
`make engine`, or one on PATH / named by DTBENCH_LLAMA_SERVER), started by these tests, no mocks (issue 30): a plain and a speculating server measured end to end at
two concurrency levels and checked against each other; base_url; and the failures: a server that does not start, a
port taken, a server that exits during a cell, an error answer, Ctrl-C of `dtbench run` during a cell. After each,
no server process is left."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from dtbench.decoders.server import ServerParams
from dtbench.harness.serving import ServerError, ServerPool, llama_server_binary
from dtbench.harness.suites.grouping import CellKey

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)

try:  # the binary {llama_server} stands for (DTBENCH_LLAMA_SERVER, the engine extra, PATH): `make engine`
    llama_server_binary()
except ServerError as _exc:
    pytest.skip(f"no llama.cpp server: {_exc}", allow_module_level=True)

pytestmark = pytest.mark.slow

ARGS = [
    "-m",
    "{model}",
    "--host",
    "{host}",
    "--port",
    "{port}",
    "--parallel",
    "{concurrency}",
    "--ctx-size",
    "4096",
    "--threads",
    "1",
    "--no-webui",
]
PLAIN = {"engine": "llama.cpp", "launch": ["{llama_server}", *ARGS]}
SPEC = {
    "engine": "llama.cpp",
    "speculative": True,
    "tie_margin": 0.25,  # suites/engine-cpu.yaml says why (the plain server flips a 0.17 margin between runs)
    "reference": PLAIN,
    "launch": [
        "{llama_server}",
        *ARGS,
        "--spec-type",
        "ngram-simple",
        "--spec-ngram-simple-size-n",
        "3",
        "--spec-ngram-simple-size-m",
        "8",
    ],
}


def _launched_by(server: psutil.Process, pid: int) -> bool:
    """Whether ``server`` descends from process ``pid``: the run itself, or (``isolation: process``, the default)
    its measuring child, which launches the servers of its cells."""
    try:
        return server.is_running() and any(p.pid == pid for p in server.parents())
    except psutil.NoSuchProcess:
        return False


def _servers() -> list[psutil.Process]:
    """llama-server processes running now (ours: the binary of the engine extra)."""
    binary = os.path.realpath(llama_server_binary())
    out = []
    for p in psutil.process_iter(["exe", "cmdline"]):
        try:
            if p.info["exe"] and os.path.realpath(p.info["exe"]) == binary:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


@pytest.fixture
def no_leftovers():
    before = {p.pid for p in _servers()}
    yield
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and {p.pid for p in _servers()} - before:
        time.sleep(0.2)
    assert not ({p.pid for p in _servers()} - before), "a llama-server process was left behind"


@pytest.fixture(scope="module")
def tokenizer():
    from dtbench.harness.models import loading as models
    from dtbench.harness.suites.suite import ModelSpec

    return models.load_tokenizer(ModelSpec())


class _P:  # a prompt as the harness hands one over
    def __init__(self, index: int, ids: list[int]):
        self.index, self.token_ids, self.document = index, ids, f"doc{index}"


def _prompts(tokenizer, n: int, repeat: int = 1) -> list[_P]:
    text = "The quick brown fox jumps over the lazy dog. " * repeat
    return [_P(i, tokenizer(f"{i}: {text}", add_special_tokens=False)["input_ids"]) for i in range(n)]


def measure_unit(label: str, params, prompts: list, gen_length: int, concurrency: int, cell: CellKey, pool, tokenizer):
    """One unit of a server cell (measured, not warmup) through the served measurer and the shared tail, as a run
    measures it (issue 58 item 4: the old ``measure_requests`` path is gone): its frozen SampleRecords. Raises what
    the measurer raises (:class:`ServerError`)."""
    from types import SimpleNamespace

    from dtbench.harness import registry
    from dtbench.harness.measurement.measurers import record_rows
    from dtbench.harness.serving.measurer import ServedMeasurer
    from dtbench.harness.suites.decoderspec import DecoderSpec
    from dtbench.harness.suites.plan import CellPlan, PromptGroup
    from dtbench.harness.suites.suite import DatasetSpec

    cp = CellPlan(DecoderSpec(name="server", label=label), registry.get("server"), params, "dtbench", "test")
    ds = DatasetSpec.model_validate({"name": "wikitext-2", "label": cell.dataset, "warmup": 0, "L_max": cell.l_max})
    rows = tuple(p.index for p in prompts)
    group = PromptGroup(ds, cell.l_max, gen_length, rows[0], (cp,), batch_size=concurrency, rows=rows)
    assert group.cell == cell and not group.warmup
    measurer = ServedMeasurer(SimpleNamespace(seed=0, lossless_check="tie_aware"), pool, tokenizer)  # type: ignore[arg-type]
    return record_rows(measurer.measure(cp, prompts, group, None, True).rows, group.warmup)


def _suite_file(tmp_path: Path, decoders: list[dict], **extra) -> Path:
    suite = {
        "name": "engine-test",
        "seed": 0,
        "device": "cpu",
        "target": {"model": "smollm2-135m"},
        "datasets": [{"name": "wikitext-2", "prompts": 5, "warmup": 1, "L_max": 64}],
        "generation_lengths": [24],
        "concurrency": [1, 2],
        "decoders": decoders,
        **extra,
    }
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path


def _run(args: list[str], tmp_path: Path, data_dir: Path, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "DTBENCH_SERVER_LOG_DIR": str(tmp_path / "logs")}
    return subprocess.run(
        [sys.executable, "-m", "dtbench.cli.main", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        **kw,
    )


def test_plain_vs_speculative_end_to_end(tmp_path, data_dir, no_leftovers):
    suite = _suite_file(
        tmp_path,
        [{"name": "server", "label": "plain", "params": PLAIN}, {"name": "server", "label": "ngram", "params": SPEC}],
    )
    db = tmp_path / "r.db"
    out = _run(["run", str(suite), "--db", f"sqlite:///{db}", "--data-dir", str(data_dir)], tmp_path, data_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    from sqlalchemy import select

    from dtbench.harness.store import db as dbm
    from dtbench.harness.store.db import Cell, Sample

    sessions = dbm.connect(f"sqlite:///{db}", create=False)
    with sessions() as s:
        cells = s.scalars(select(Cell)).all()
        assert sorted((c.label, c.batch_size, c.status) for c in cells) == [
            ("ngram", 1, "done"),
            ("ngram", 2, "done"),
            ("plain", 1, "done"),
            ("plain", 2, "done"),
        ]
        assert {c.family for c in cells} == {"external"}
        spec = s.scalars(select(Sample).join(Cell).where(Cell.label == "ngram")).all()
        plain = s.scalars(select(Sample).join(Cell).where(Cell.label == "plain")).all()
    assert len(spec) == len(plain) == 10  # 5 prompts at each of the two concurrency levels
    for row in spec:
        st = row.step_stats["server"]
        assert row.new_tokens == 24 and len(row.output_tokens) == 24
        assert row.ttft_s > 0 and row.total_s >= row.ttft_s and row.tpot_s > 0
        assert row.lossless is True, (row.first_divergence, row.lossless_diagnoses)  # equal, or a classified tie
        assert st["lossless_rule"].startswith("tie_aware")
        if st["acceptance"]:  # llama.cpp reports draft_n only for a request it drafted for
            assert st["acceptance"]["drafted"] >= st["acceptance"]["accepted"] >= 0
            assert row.drafted == st["acceptance"]["drafted"] and row.accepted == st["acceptance"]["accepted"]
        assert sum(st["tokens_per_read"]) == 24 and Path(st["log"]).is_file()
    sources = {r.step_stats["server"]["acceptance"].get("source") for r in spec}
    assert "llama.cpp timings.draft_n/draft_n_accepted" in sources  # the n-gram drafter drafted somewhere
    for row in plain:
        assert row.lossless is None and row.step_stats["server"]["acceptance"] == {}  # no speculation reported
    batched = [r for r in spec if r.batch_group is not None]
    assert len(batched) == 5 and all(r.batch_total_s >= r.total_s for r in batched)
    logs = list((tmp_path / "logs").glob("*.log"))
    assert len(logs) == 4 and all("# dtbench:" in p.read_text(errors="replace") for p in logs)  # one server per cell

    rep = _run(["report", "--engine", "--db", f"sqlite:///{db}", "--format", "json"], tmp_path, data_dir)
    assert rep.returncode == 0, rep.stderr
    rows = {(r["label"], r["batch_size"]): r for r in json.loads(rep.stdout)["rows"]}
    assert rows[("ngram", 2)]["reference"] == "plain" and rows[("ngram", 2)]["n"] >= 1
    assert rows[("ngram", 1)]["speedup"] > 0 and rows[("ngram", 1)]["tpot_p99_s"] >= rows[("ngram", 1)]["tpot_p50_s"]
    assert rows[("ngram", 1)]["lossless"] == "yes" and rows[("plain", 1)]["reference"] is None
    assert any(rows[("ngram", b)]["accept_source"].startswith("llama.cpp") for b in (1, 2))


def test_base_url_server_the_user_runs(tmp_path, tokenizer, no_leftovers):
    pool = ServerPool(tmp_path / "logs")
    try:
        base, launched = pool.endpoint("mine", ServerParams(**PLAIN), CellKey("d", 1, 8, 1), 1)  # someone's server
        rows = measure_unit(
            "user's", ServerParams(base_url=base), _prompts(tokenizer, 2), 8, 2, CellKey("d", 1, 8, 2), pool, tokenizer
        )
        assert [len(r.output_tokens) for r in rows] == [8, 8]  # frozen SampleRecords (issue 49 item 5)
        assert rows[0].step_stats["server"]["log"] is None and rows[0].batch_rows == 2
        assert launched.exited() is None  # a base_url server is never stopped by dtbench
    finally:
        pool.close()


def test_server_that_does_not_start(tmp_path, data_dir, no_leftovers):
    broken = {
        "engine": "llama.cpp",
        "launch": ["{llama_server}", "-m", str(tmp_path / "missing.gguf"), "--port", "{port}"],
        "startup_timeout_s": 60,
    }
    suite = _suite_file(tmp_path, [{"name": "server", "label": "broken", "params": broken}], concurrency=[1])
    db = tmp_path / "r.db"
    out = _run(["run", str(suite), "--db", f"sqlite:///{db}", "--data-dir", str(data_dir)], tmp_path, data_dir)
    from sqlalchemy import select

    from dtbench.harness.store import db as dbm
    from dtbench.harness.store.db import Cell, Sample

    with dbm.connect(f"sqlite:///{db}", create=False)() as s:
        cell = s.scalars(select(Cell)).one()
        assert cell.status == "failed" and s.scalars(select(Sample)).all() == []
    assert "server 'broken' exited with code" in cell.error and "see its log" in cell.error
    assert "\n" not in cell.error and "Traceback" not in out.stderr
    assert Path(cell.error.rsplit("see its log ", 1)[1]).is_file()


def test_port_taken(tmp_path, tokenizer, no_leftovers):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        pool = ServerPool(tmp_path / "logs")
        with pytest.raises(ServerError, match=f"server 'p': port {port} is taken"):
            pool.endpoint("p", ServerParams(**{**PLAIN, "port": port}), CellKey("d", 1, 8, 1), 1)
        pool.close()


def test_server_exits_during_a_cell_and_error_answers(tmp_path, tokenizer, no_leftovers):
    pool = ServerPool(tmp_path / "logs")
    try:
        params = ServerParams(**PLAIN)
        _, server = pool.endpoint("dies", params, CellKey("d", 1, 600, 1), 1)
        threading.Timer(1.5, server.proc.kill).start()  # while the request streams (600 tokens take longer)
        with pytest.raises(ServerError, match=r"server 'dies' exited with code -9 during the cell; see its log"):
            measure_unit("dies", params, _prompts(tokenizer, 1), 600, 1, CellKey("d", 1, 600, 1), pool, tokenizer)
        small = ServerParams(**{**PLAIN, "launch": [a if a != "4096" else "128" for a in PLAIN["launch"]]})
        with pytest.raises(ServerError, match=r"server 'small': answered HTTP 4\d\d: .*; see its log"):
            prompts = _prompts(tokenizer, 1, repeat=40)
            measure_unit("small", small, prompts, 8, 1, CellKey("d", 2, 8, 1), pool, tokenizer)
    finally:
        pool.close()


def test_ctrl_c_during_a_cell(tmp_path, data_dir, no_leftovers):
    slow = {**PLAIN, "launch": PLAIN["launch"]}
    suite = _suite_file(
        tmp_path, [{"name": "server", "label": "slow", "params": slow}], concurrency=[1], generation_lengths=[400]
    )
    db = tmp_path / "r.db"
    env = {**os.environ, "DTBENCH_SERVER_LOG_DIR": str(tmp_path / "logs")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dtbench.cli.main",
            "run",
            str(suite),
            "--db",
            f"sqlite:///{db}",
            "--data-dir",
            str(data_dir),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any(_launched_by(p, proc.pid) for p in _servers()):
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    time.sleep(2.0)  # the server is up and the first request streams
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "interrupted" in err and "Traceback" not in err
    from sqlalchemy import select

    from dtbench.harness.store import db as dbm
    from dtbench.harness.store.db import Cell, Run

    with dbm.connect(f"sqlite:///{db}", create=False)() as s:
        assert s.scalars(select(Run)).one().status == "interrupted"
        assert s.scalars(select(Cell)).one().status != "done"
