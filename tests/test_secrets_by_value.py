"""Issue 59 items 1 and 2: secrets scrubbed by value, literal credentials refused wherever a suite holds them.

Item 1 as the probe found it: a server that answers 401 or 500 with a body quoting the request's headers put the
``api_key_env`` key (``Authorization: Bearer <key>``) and a ``base_url`` password (httpx's ``Authorization: Basic
<base64(user:password)>``) into ``cells.error`` and every report format. Item 2: literal keys that got past the
refusal at validate (an ``extra_body`` key holding a list or a number, a URL fragment, ``--api-key KEY`` in a
``launch:`` argv) and ``api_key_env: PATH``.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kit import invoke, one_line_error, write_suite

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57); runs are in-process (isolation: none)

TINY = {
    "name": "tiny",
    "seed": 0,
    "device": "cpu",
    "target": {"model": "smollm2-135m", "dtype": "float32"},
    "datasets": [{"name": "wikitext-2", "prompts": 2, "warmup": 1, "L_max": 16}],
    "generation_lengths": [4],
    "isolation": "none",
}
KEY = "sk-Q7vEchoedKey"  # the API key, read from DTB_ECHO_KEY
PASSWORD = "Zq9'W v<x"  # the base_url password: a quote, a space and "<" (issue 50's hard cases)
BASIC = base64.b64encode(f"admin:{PASSWORD}".encode()).decode()  # what httpx sends for the URL's credentials


@pytest.fixture(autouse=True)
def _no_secrets_between_tests():
    """The secret registry is process-wide: each test starts and ends without another test's secrets."""
    from dtbench.core import forget_secrets

    forget_secrets()
    yield
    forget_secrets()


@pytest.fixture
def echo_server():
    """``echo_server(status)``: a server whose health check answers 200 and whose every completion request is
    answered ``status`` with a JSON body quoting the request's headers (as the probe's server did); its URL."""
    started = []

    def start(status: int) -> str:
        class Echo(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _answer(self, code: int, data: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer(200, b"ok")

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                auth = self.headers.get("Authorization", "")
                body = {"error": f"bad credentials: {auth}", "headers": dict(self.headers.items())}
                self._answer(status, json.dumps(body).encode())

        server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in started:
        server.shutdown()


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A 1-layer Llama over SmolLM2's tokenizer (tests/kit.py): a served run loads its target's tokenizer and model,
    and this one loads in a fraction of the embedded SmolLM2's seconds."""
    from kit import save_tiny_llama

    from dtbench.harness.models import loading as models
    from dtbench.harness.suites.suite import ModelSpec

    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny"), models.load_tokenizer(ModelSpec())))


def _reports(db) -> list[str]:
    """Every report format's output (the load view's too) and the HTML page."""
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


# --- 59.1 a server's error body that echoes the request headers ------------------------------------------------------


@pytest.mark.parametrize("isolation", ["none", pytest.param("process", marks=pytest.mark.full)])  # full: a child
def test_echoed_bearer_key_and_basic_password_are_stored_and_shown_nowhere(
    tmp_path, data_dir, echo_server, tiny_target, monkeypatch, isolation
):
    monkeypatch.setenv("DTB_ECHO_KEY", KEY)
    keyed = {"base_url": echo_server(401), "api_key_env": "DTB_ECHO_KEY"}
    basic = {"base_url": echo_server(500).replace("http://", f"http://admin:{PASSWORD}@")}
    import fakeserver

    server, plain = fakeserver.serve()  # a server that answers: the reports have a run to show
    decoders = [
        {"name": "server", "label": "plain", "params": {"base_url": plain}},
        {"name": "server", "label": "keyed", "params": keyed},
        {"name": "server", "label": "basic", "params": basic},
    ]
    db = tmp_path / "r.db"
    target = {"model": tiny_target, "dtype": "float64"}
    suite = write_suite(tmp_path, {**TINY, "target": target, "decoders": decoders, "isolation": isolation})
    try:
        result = invoke("run", suite, "--db", str(db), "--data-dir", str(data_dir), "--no-progress")
    finally:
        server.shutdown()
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    import sqlite3

    with sqlite3.connect(db) as con:
        errors = dict(con.execute("select label, error from cells").fetchall())
    # the cells failed on the servers' answers, which are kept: only the secrets in them are masked
    assert "answered HTTP 401" in errors["keyed"] and "Bearer ***" in errors["keyed"], errors
    assert "answered HTTP 500" in errors["basic"] and "Basic ***" in errors["basic"], errors
    stored = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("r.db"))  # with -wal, -journal
    reports = _reports(db)
    assert sum("answered HTTP 401" in text for text in reports) >= 5  # the reports show the cells' errors
    shown = "\n".join([result.output, *reports])
    for secret in (KEY, PASSWORD, f"admin:{PASSWORD}", BASIC, "Zq9"):
        assert secret.encode() not in stored, secret
        assert secret not in shown, secret


def test_registered_secrets_are_masked_in_every_encoding_a_server_echoes():
    from urllib.parse import quote

    from dtbench.core import redact_credentials, redact_json, register_secret, register_url_secrets
    from dtbench.harness.safetext import printable

    register_secret('sk-a/b"c d')
    register_url_secrets("http://tok%40en:p%20w%3Ad@h:1/v1?api_key=QUERYKEY1#access_token=FRAGKEY1&page=2")
    echoed = {
        "json": json.dumps({"Authorization": 'Bearer sk-a/b"c d'}),
        "quoted": quote('sk-a/b"c d', safe=""),
        "decoded password": "p w:d",
        "basic": "Basic " + base64.b64encode(b"tok@en:p w:d").decode(),
        "query": "QUERYKEY1",
        "fragment": "FRAGKEY1",
    }
    for how, text in echoed.items():  # text from a server: masked by value (printable masks URLs by structure only)
        assert "***" in redact_credentials(text), how
        for part in ("sk-a", "p w:d", "QUERYKEY1", "FRAGKEY1", base64.b64encode(b"tok@en:p w:d").decode()):
            assert part not in redact_credentials(text), (how, part)
    assert redact_json({"e": ["x FRAGKEY1 y", 3]}) == {"e": ["x *** y", 3]}
    from dtbench.core import redact_yaml

    # what the user wrote is never searched for a registered value (issue 67 item 1): a literal key is refused at
    # validate, and a value found in the user's own words is no key
    assert redact_yaml('a: "QUERY\\x4bEY1"\nb: wiki QUERYKEY1\n') == 'a: "QUERY\\x4bEY1"\nb: wiki QUERYKEY1\n'
    assert printable("dataset QUERYKEY1") == "dataset QUERYKEY1"
    # a fragment's key-like parameters are masked by the URL rule too, with nothing registered
    from dtbench.core import forget_secrets

    forget_secrets()
    assert redact_credentials("http://h:1/v1#access_token=K9&page=2 ok") == "http://h:1/v1#access_token=***&page=2 ok"
    assert redact_credentials("http://h/cb?http://u:pw@x/y") == "http://h/cb?http://u:***@x/y"
    register_secret("abc")  # shorter than MIN_SECRET: ordinary text is left alone
    assert redact_credentials("abc") == "abc"


# --- 59.2 literal keys that got past validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"extra_body": {"api_key": ["sk-LITERAL"]}}, "params.extra_body.api_key: a literal credential"),
        ({"extra_body": {"api_key": 123456789}}, "params.extra_body.api_key: a literal credential"),
        ({"base_url": "http://127.0.0.1:8000/#access_token=sk-LITERAL"}, "fragment parameter 'access_token'"),
        ({"launch": ["llama-server", "--api-key", "sk-LITERAL"]}, "params.launch: argument '--api-key': a literal"),
        ({"launch": ["vllm", "serve", "--api-key=sk-LITERAL"]}, "params.launch: argument '--api-key': a literal"),
    ],
)
def test_a_literal_key_of_any_type_or_place_is_refused(tmp_path, params, needle):
    params = {"base_url": "http://127.0.0.1:8000", **params}
    if "launch" in params:
        params.pop("base_url")
    suite = write_suite(tmp_path, {**TINY, "decoders": [{"name": "server", "params": params}]})
    line = one_line_error(invoke("validate", suite), needle)
    assert "LITERAL" not in line and "123456789" not in line, line
    if "launch" in params:
        assert "LLAMA_API_KEY" in line and "api_key_env" in line, line


def test_a_key_file_flag_and_flags_without_a_key_pass(tmp_path):
    launch = ["llama-server", "--api-key-file", "/run/keys", "--no-auth", "--port", "{port}"]
    extra = {"use_auth": True, "session_params": {"rid": "r1"}, "max_tokens": 3}
    decoders = [
        {"name": "server", "label": "a", "params": {"launch": launch}},
        {
            "name": "server",
            "label": "b",
            "params": {"base_url": "http://127.0.0.1:8000/#section-2", "extra_body": extra},
        },
    ]
    result = invoke("validate", write_suite(tmp_path, {**TINY, "decoders": decoders}))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("name", ["PATH", "HOME", "LC_ALL"])
def test_api_key_env_naming_a_system_variable_is_refused(tmp_path, monkeypatch, name):
    monkeypatch.setenv(name, "/usr/bin:/bin")
    params = {"base_url": "http://127.0.0.1:8000", "api_key_env": name}
    suite = write_suite(tmp_path, {**TINY, "decoders": [{"name": "server", "params": params}]})
    line = one_line_error(invoke("validate", suite), f"params.api_key_env: {name} is a system variable, not an API key")
    assert "/usr/bin" not in line


# --- 67.1 masking never rewrites what the user wrote ----------------------------------------------------------------


def test_a_key_that_occurs_in_the_users_own_text_never_rewrites_it(
    tmp_path, data_dir, echo_server, tiny_target, monkeypatch, request
):
    """issue 67 item 1. Before: with a key whose value occurs in the suite name, a label and a dataset name, the run
    stored ``name: c_***``, the dataset as ``***text-2`` and the label ``srv_***``. Now the user's text is stored and
    printed as written (byte for byte what a run without the key stores), and the key echoed by a server is still
    masked in what the server sent."""
    import sqlite3

    key = "wikitext"  # 8 characters: long enough to be a key; in the suite name, a label and the dataset's name
    url = echo_server(401)  # answers 401 quoting the request's headers (the key among them)
    import fakeserver

    server, plain = fakeserver.serve()  # a server that answers: the reports have samples to show
    request.addfinalizer(server.shutdown)

    def run(folder, with_key: bool):
        folder.mkdir()
        params = {"base_url": url, **({"api_key_env": "DTB_WIKI_KEY"} if with_key else {})}
        decoders = [
            {"name": "server", "label": "ok", "params": {"base_url": plain}},
            {"name": "server", "label": "srv_wikitext", "params": params},
        ]
        target = {"model": tiny_target, "dtype": "float64"}
        suite = {**TINY, "name": "c_wikitext", "target": target, "decoders": decoders}
        db = folder / "r.db"
        args = ("--db", str(db), "--data-dir", str(data_dir), "--no-progress")
        result = invoke("run", write_suite(folder, suite), *args)
        assert "Traceback" not in result.output, result.output
        with sqlite3.connect(db) as con:
            text, env = con.execute("select suite_text, environment from runs").fetchone()
            label, dataset, error = con.execute(
                "select label, dataset, error from cells where label != 'ok'"
            ).fetchone()
        return text, env, label, dataset, error, result, db

    without = run(tmp_path / "plain", False)
    monkeypatch.setenv("DTB_WIKI_KEY", key)
    text, env, label, dataset, error, result, db = run(tmp_path / "keyed", True)
    assert (label, dataset) == (without[2], without[3]) == ("srv_wikitext", "wikitext-2")
    kept = "".join(line for line in text.splitlines(keepends=True) if "api_key_env" not in line)
    assert kept == without[0] and "name: c_wikitext" in text  # byte for byte, but the api_key_env line
    assert "***" not in env and "***" not in without[1]  # the environment record: nothing rewritten
    assert "Bearer ***" in error and f"Bearer {key}" not in error  # what the server echoed: masked by value
    shown = "\n".join([result.output, *_reports(db)])
    assert "srv_wikitext" in shown and "***text" not in shown and f"Bearer {key}" not in shown


def test_a_key_too_short_to_mask_is_refused_naming_the_variable(tmp_path, monkeypatch):
    """issue 67 item 1: a 1-7 character key (``abc``; local servers' dummies such as ``EMPTY``) can be neither masked
    without rewriting ordinary text nor left shown: refused before the run, naming the variable, never the value."""
    monkeypatch.setenv("DTB_SHORT_KEY", "abc")
    params = {"base_url": "http://127.0.0.1:8000", "api_key_env": "DTB_SHORT_KEY"}
    suite = write_suite(tmp_path, {**TINY, "decoders": [{"name": "server", "params": params}]})
    line = one_line_error(invoke("validate", suite), "api_key_env: the key in DTB_SHORT_KEY is 3 characters")
    assert "abc" not in line.split("DTB_SHORT_KEY", 1)[1]


def test_a_key_echoed_lower_cased_or_repr_escaped_is_masked():
    """issue 67 (low): a server lower-casing an echoed header, or a traceback showing the key in a repr."""
    from dtbench.core import redact_credentials, register_secret

    key = "sk-Mixed\\Case\tKey"  # a backslash and a tab: a repr escapes both
    register_secret(key)
    assert redact_credentials(f"echo: {key.lower()}") == "echo: ***"
    assert redact_credentials(f"KeyError: {key!r}") == "KeyError: '***'"


@pytest.mark.parametrize("cut", [1, 7, 14])
def test_a_key_echoed_split_across_two_lines_is_masked(cut):
    """issue 67 (low): a server wrapping a long header over two lines (a real line break with the next line's indent,
    CRLF, or a JSON/repr-escaped ``\\n``) echoed the key in two halves that no exact match finds."""
    from dtbench.core import redact_credentials, register_secret

    register_secret(KEY)
    head, tail = KEY[:cut], KEY[cut:]
    for joint in ("\n", "\n    ", "\r\n\t", "\\n", "\\r\\n  "):
        text = f"Authorization: Bearer {head}{joint}{tail} was refused\nnext line"
        assert redact_credentials(text) == "Authorization: Bearer *** was refused\nnext line", joint
    upper = f"{KEY.upper()[:cut]}\n{KEY.upper()[cut:]}"
    assert KEY.upper()[cut:] not in redact_credentials(upper)
    assert redact_credentials("a line\nand another, no key") == "a line\nand another, no key"
