"""Issue 50: secrets in server URLs and API keys (items 1-3), Markdown link injection (item 4).

Each test is written against what the issue reported: a password holding a quote, a space or ``<`` shown in the
terminal, the stored suite text, the cells and every report format; a reference server's password in the cells'
labels; no safe place for an API key; a label that became a live Markdown link.
"""

from __future__ import annotations

import json
import re
import sqlite3

import pytest
from kit import invoke, one_line_error, write_suite

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

TINY = {
    "name": "tiny",
    "seed": 0,
    "device": "cpu",
    "target": {"model": "smollm2-135m", "dtype": "float32"},
    "datasets": [{"name": "wikitext-2", "prompts": 2, "warmup": 1, "L_max": 16}],
    "generation_lengths": [4],
    "isolation": "none",  # in this process: a child per run cost 8-9 s of a test's 11-16 s (issue 57)
}


@pytest.fixture
def fake_server():
    """``fake_server(**options)``: a fake completions server (tests/fakeserver.py) in a thread; (URL, server)."""
    import fakeserver

    started = []

    def start(**options):
        server, url = fakeserver.serve(**options)
        started.append(server)
        return url, server

    yield start
    for server in started:
        server.shutdown()


def _run(tmp_path, data_dir, suite: str):
    return invoke("run", suite, "--db", str(tmp_path / "r.db"), "--data-dir", str(data_dir), "--no-progress")


def _database_text(path) -> str:
    with sqlite3.connect(path) as con:
        return "\n".join(con.iterdump())


def _reports(db) -> list[str]:
    """Every report format's output, the load view's too, and the HTML page."""
    seen = []
    for fmt in ("table", "markdown", "csv", "json", "html"):
        for extra in ((), ("--engine",)):
            report = invoke("report", "--db", str(db), "--format", fmt, *extra)
            assert report.exit_code == 0, report.output
            seen.append(report.output)
    page = db.parent / "r.html"
    assert invoke("report", "--db", str(db), "--html", str(page)).exit_code == 0
    seen.append(page.read_text())
    return seen


# --- 50.1 a password holding a quote, a space or "<": masked everywhere, by parsing the URL -------------------------

PASSWORDS = {  # label -> (password, how the suite's YAML writes the URL: {url} is the server's host:port)
    "squote": ("SECRET1'x", '"http://admin:SECRET1\'x@{url}"'),
    "dquote": ('SECRET2"x', "'http://admin:SECRET2\"x@{url}'"),
    "space": ("SECRET3 x", '"http://admin:SECRET3 x@{url}"'),
    "angle": ("SECRET4<x", "http://admin:SECRET4<x@{url}"),
    "escaped": ('SECRET5"y', '"http://admin:SECRET5\\"y@{url}"'),  # YAML's own escape: the text never holds it
}


@pytest.mark.full  # end-to-end runs against a fake server
def test_passwords_with_quotes_spaces_and_brackets_are_masked_everywhere(tmp_path, data_dir, fake_server):
    url, _ = fake_server()
    host = url.removeprefix("http://")
    lines = [f"{k}: {json.dumps(v)}" for k, v in TINY.items()] + ["decoders:"]
    for label, (_, written) in PASSWORDS.items():
        lines += ["  - name: server", f"    label: {label}", f"    params: {{base_url: {written.format(url=host)}}}"]
    suite = write_suite(tmp_path, "\n".join(lines) + "\n")
    result = _run(tmp_path, data_dir, suite)
    assert result.exit_code == 0, result.output
    seen = [result.output, _database_text(tmp_path / "r.db"), *_reports(tmp_path / "r.db")]
    everything = "\n".join(seen)
    for password, _ in PASSWORDS.values():
        for part in {password, password.split()[0], password.replace('"', "%22").replace(" ", "%20")}:
            assert part not in everything, part
    with sqlite3.connect(tmp_path / "r.db") as con:
        (text,) = con.execute("select suite_text from runs").fetchone()
        params = [json.loads(p)["base_url"] for (p,) in con.execute("select params from cells")]
    assert text.count("admin:***@") == len(PASSWORDS), text
    assert sorted(params) == [f"http://admin:***@{host}"] * len(PASSWORDS)


def test_redaction_parses_urls_in_free_text_and_structures():
    from dtbench.core import redact_credentials, redact_json, redact_yaml

    assert redact_credentials("http://admin:SECRET1'x@h:1/v1") == "http://admin:***@h:1/v1"
    assert redact_credentials('at http://admin:S"x y<z@h:1 failed') == "at http://admin:***@h:1 failed"
    assert redact_credentials('{"u": "https://a:p@ss@h", "m": "x@y"}') == '{"u": "https://a:***@h", "m": "x@y"}'
    assert redact_credentials("{'u': 'http://a:it\\'s@h'}") == "{'u': 'http://a:***@h'}"
    assert redact_credentials("a http://b http://c:p@d/x") == "a http://b http://c:***@d/x"
    assert (
        redact_credentials("http://h/v1?model=m&api_key=K1&X-Amz-Signature=K2&accessToken=K3#f")
        == "http://h/v1?model=m&api_key=***&X-Amz-Signature=***&accessToken=***#f"
    )
    assert redact_credentials('"http://h/?token=K", "max_tokens": 4') == '"http://h/?token=***", "max_tokens": 4'
    assert redact_credentials("http://h/cb?next=http://u:p@x/y") == "http://h/cb?next=http://u:***@x/y"
    assert redact_json({"u": ["http://a:p q@h"], "n": 3}) == {"u": ["http://a:***@h"], "n": 3}
    folded = 'u: "http://a:SEC\n  RET@h"\nv: [1]\n'  # a double-quoted scalar folded over two lines
    assert "SEC" not in redact_yaml(folded) and "RET" not in redact_yaml(folded)
    assert redact_yaml(folded).endswith("\nv: [1]\n")


# --- 50.2 a reference server's label: built from its params, masked like them ---------------------------------------


@pytest.mark.full  # end-to-end runs against a fake server
def test_a_reference_servers_label_holds_no_password(tmp_path, data_dir, fake_server):
    plain, _ = fake_server()
    spec, _ = fake_server()
    ref = {"base_url": plain.replace("http://", "http://admin:SECRET7@")}
    sweep = {"base_url": [spec.replace("http://", "http://admin:SECRET8@")]}
    decoders = [{"name": "server", "label": "spec", "params": {"speculative": True, "reference": ref}, "sweep": sweep}]
    result = _run(tmp_path, data_dir, write_suite(tmp_path, {**TINY, "decoders": decoders}))
    assert result.exit_code == 0, result.output
    with sqlite3.connect(tmp_path / "r.db") as con:
        labels = con.execute("select label, reference_label from cells order by id").fetchall()
    host, spec_host = plain.removeprefix("http://"), spec.removeprefix("http://")
    assert labels == [
        (f"server (base_url=http://admin:***@{host})", None),
        (f"spec (base_url=http://admin:***@{spec_host})", f"server (base_url=http://admin:***@{host})"),
    ]
    assert "SECRET" not in result.output + _database_text(tmp_path / "r.db")


# --- 50.3 an API key: read from the environment at request time, sent as a bearer token, never stored ---------------


@pytest.mark.full  # end-to-end runs against a fake server
def test_an_api_key_is_read_from_the_environment_and_never_stored(tmp_path, data_dir, fake_server, monkeypatch):
    plain, plain_server = fake_server(tokens=(5, 9, 7))
    spec, spec_server = fake_server(tokens=(5, 6, 7))
    monkeypatch.setenv("DTB_PLAIN_KEY", "sk-PLAINKEY")
    monkeypatch.setenv("DTB_SPEC_KEY", "sk-SPECKEY")
    ref = {"base_url": plain, "api_key_env": "DTB_PLAIN_KEY"}
    params = {"base_url": spec, "api_key_env": "DTB_SPEC_KEY", "speculative": True, "reference": ref}
    suite = write_suite(tmp_path, {**TINY, "decoders": [{"name": "server", "label": "spec", "params": params}]})
    result = _run(tmp_path, data_dir, suite)
    assert result.exit_code == 3, result.output  # diverged: the check request asked the plain server too
    # every request, the check request to the reference included, carried its own server's key
    assert set(plain_server.authorizations) == {"Bearer sk-PLAINKEY"}, plain_server.authorizations
    assert set(spec_server.authorizations) == {"Bearer sk-SPECKEY"} and len(plain_server.authorizations) > 2
    everything = "\n".join([result.output, _database_text(tmp_path / "r.db"), *_reports(tmp_path / "r.db")])
    assert "PLAINKEY" not in everything and "SPECKEY" not in everything
    with sqlite3.connect(tmp_path / "r.db") as con:
        stored = [json.loads(p) for (p,) in con.execute("select params from cells order by id")]
    assert stored[1]["api_key_env"] == "DTB_SPEC_KEY" and stored[1]["reference"]["api_key_env"] == "DTB_PLAIN_KEY"
    monkeypatch.delenv("DTB_PLAIN_KEY")
    for command in ("validate", "run"):
        args = ("--db", str(tmp_path / "r2.db"), "--data-dir", str(data_dir)) if command == "run" else ()
        one_line_error(
            invoke(command, suite, *args),
            "reference of decoder 'spec'",
            "params.api_key_env: the environment variable DTB_PLAIN_KEY is not set",
        )


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"extra_body": {"api_key": "sk-LITERAL"}}, "params.extra_body.api_key: a literal credential"),
        ({"extra_body": {"headers": {"X-Auth-Token": "sk-LITERAL"}}}, "params.extra_body.headers.X-Auth-Token: a"),
        ({"base_url": "http://127.0.0.1:8000/?key=sk-LITERAL"}, "params.base_url: query parameter 'key': a literal"),
    ],
)
def test_a_literal_key_is_refused_pointing_to_api_key_env(tmp_path, data_dir, params, needle):
    params = {"base_url": "http://127.0.0.1:8000", **params}
    suite = write_suite(tmp_path, {**TINY, "decoders": [{"name": "server", "params": params}]})
    for command in ("validate", "run"):
        args = ("--db", str(tmp_path / "r.db"), "--data-dir", str(data_dir)) if command == "run" else ()
        line = one_line_error(invoke(command, suite, *args), needle, "name the variable with api_key_env")
        assert "LITERAL" not in line
    ok = {"base_url": "http://127.0.0.1:8000", "extra_body": {"max_tokens": 3, "return_tokens_as_token_ids": True}}
    assert (
        invoke("validate", write_suite(tmp_path, {**TINY, "decoders": [{"name": "server", "params": ok}]})).exit_code
        == 0
    )


# --- 50.4 a label is text in Markdown, never a link -----------------------------------------------------------------


def test_a_markdown_label_never_becomes_a_link(tmp_path):
    import reportdb

    label = "[c](javascript:alert(1))"
    path = tmp_path / "r.db"
    with reportdb.connect(path)() as session:
        run = reportdb.add_run(session)
        reportdb.add_samples(session, reportdb.add_cell(session, run, "ar"), [1.0] * 4, warmup=1)
        reportdb.add_samples(session, reportdb.add_cell(session, run, label, "linear"), [2.0] * 4, warmup=1)
        session.commit()
    for extra in ((), ("--compare",)):
        result = invoke("report", "--db", str(path), "--format", "markdown", *extra)
        assert result.exit_code == 0, result.output
        assert re.search(r"(?<!\\)\]\(", result.stdout) is None, result.stdout  # no "](" that links
        assert "\\[c\\](javascript:alert(1))" in result.stdout, result.stdout


def test_markdown_cells_escape_link_code_and_cell_syntax():
    from dtbench.harness.safetext import markdown_cell

    assert markdown_cell("[x](u) `c` a|b \\[y\\]") == "\\[x\\](u) \\`c\\` a\\|b \\\\\\[y\\\\\\]"
    assert markdown_cell("<img src=x>\nL_max") == "&lt;img src=x&gt;<br>L_max"


# --- 50.5 low items: one line for what a user got wrong -------------------------------------------------------------


def test_an_invalid_port_is_refused_at_validate_and_exception_groups_are_unwrapped(tmp_path):
    from dtbench.harness.errors import error_line

    params = {"base_url": "http://admin:SECRET9@127.0.0.1:99999"}
    suite = write_suite(tmp_path, {**TINY, "decoders": [{"name": "server", "params": params}]})
    line = one_line_error(invoke("validate", suite), "params.base_url: 'http://admin:***@127.0.0.1:99999' has no valid")
    assert "SECRET9" not in line
    group = ExceptionGroup("unhandled errors in a TaskGroup", [ValueError("Invalid port: '99999'")])
    assert error_line(ExceptionGroup("outer", [group])) == "ValueError: Invalid port: '99999'"


@pytest.mark.parametrize("under", [False, True])
def test_a_compile_cache_variable_naming_a_file_is_one_line(tmp_path, data_dir, monkeypatch, under):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker / "sub" if under else blocker))
    suite = write_suite(tmp_path, {**TINY, "decoders": [{"name": "ar"}]})
    for command in ("validate", "run"):
        args = ("--db", str(tmp_path / "r.db"), "--data-dir", str(data_dir)) if command == "run" else ()
        one_line_error(invoke(command, suite, *args), "TORCHINDUCTOR_CACHE_DIR names", "not a folder")


def test_every_report_option_a_suite_documents_exists():
    from pathlib import Path

    from dtbench.cli.main import cli

    options = {o for p in cli.commands["report"].params for o in p.opts}
    documented = set()
    for path in (Path(__file__).parents[1] / "suites").glob("*.yaml"):
        for line in path.read_text().splitlines():
            if "dtbench report" in line:
                documented |= set(re.findall(r"(--[a-z][a-z-]*)", line.split("dtbench report", 1)[1].split("#")[0]))
    assert "--execution" in documented and documented <= options, documented - options


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"concurrency": [0]}, "concurrency: levels (requests in flight) must be between 1 and 4096, got 0"),
        ({"concurrency": [2, 2]}, "concurrency: lists a value twice"),
        ({"params": {"request_rate": [2, 2.0]}}, "sweep over 'request_rate' lists one value twice (2 and 2.0)"),
        ({"sweep": {"top_logprobs": [2, 3, 2]}}, "sweep over 'top_logprobs' lists one value twice (2 and 2)"),
    ],
)
def test_list_axes_name_themselves_and_refuse_equal_values(tmp_path, changes, needle):
    server = {"name": "server", "params": {"base_url": "http://127.0.0.1:8000", **changes.pop("params", {})}}
    suite = {**TINY, "decoders": [{**server, **{k: v for k, v in changes.items() if k == "sweep"}}]}
    suite.update({k: v for k, v in changes.items() if k != "sweep"})
    line = one_line_error(invoke("validate", write_suite(tmp_path, suite)), needle)
    assert "batch_sizes" not in line


@pytest.mark.full  # end-to-end runs against a fake server
def test_a_divergence_found_by_the_exact_rule_is_noted_by_that_rule(tmp_path, data_dir, fake_server):
    no_top = json.dumps({"choices": [{"text": "x", "index": 0}]})  # a check answer without top candidates
    plain, _ = fake_server(tokens=(5, 9, 7), check=no_top)  # so the exact rule applies
    spec, _ = fake_server(tokens=(5, 6, 7))
    params = {"base_url": spec, "speculative": True, "reference": {"base_url": plain}}
    suite = {**TINY, "lossless_check": "tie_aware", "decoders": [{"name": "server", "label": "spec", "params": params}]}
    assert _run(tmp_path, data_dir, write_suite(tmp_path, suite)).exit_code == 3
    report = invoke("report", "--db", str(tmp_path / "r.db"), "--format", "markdown").stdout
    note = next(line for line in report.splitlines() if line.startswith("- spec is not lossless"))
    assert "tie-aware" not in note and "emitted a token the target does not choose" not in note, note
    assert "samples (warmup included) match" in note and "first divergence at token 1" in note, note


def test_a_vllm_schedule_where_no_k_pays_is_no_speculative_config():
    from dtbench.reports.pricing.schedule import engine_config

    config = engine_config("vllm", [(1, 16, 0)])
    assert config["speculative_config"] is None and "num_speculative_tokens" not in json.dumps(config)
    assert config["do_not_speculate"].startswith("serve without --speculative-config")
    assert engine_config("vllm", [(1, 4, 3), (8, 16, 0)])["speculative_config"] == {
        "num_speculative_tokens": 3,
        "disable_by_batch_size": 8,
    }


def test_the_execution_report_notes_a_decoder_only_where_it_ran(tmp_path):
    import reportdb

    path = tmp_path / "r.db"
    with reportdb.connect(path)() as session:
        run = reportdb.add_run(session)
        for label, T, execution in [("ar", 64, "eager"), ("ar [compiled]", 64, "compiled"), ("linear", 32, "eager")]:
            cell = reportdb.add_cell(session, run, label, label.split()[0], T=T)
            cell.execution = execution
            reportdb.add_samples(session, cell, [10.0, 11.0, 12.0, 13.0], warmup=1)
        session.commit()
    shown = invoke("report", "--db", str(path), "--execution", "--format", "markdown").stdout
    notes = [line for line in shown.splitlines() if line.startswith("- ")]
    assert notes == ["- one execution only (no pair) at wikitext-2 · L_max=128 · T=32: linear"], shown
