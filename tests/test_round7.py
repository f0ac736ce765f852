"""Issue 67 ("Nothing runs that nobody asked for, round 7"), the items this stop fixed: `validate` warns when a cell
measures fewer prompts after warmup than an interval needs; `dtbench decoders` shows a default_factory's value, not
pydantic's PydanticUndefined; a bad DTBENCH_PLUGIN_IMPORT_TIMEOUT is one line and exit 2 (before: every plugin
"failed to load", exit 0), and `inf` means no limit. (Cross-run `--compare` pairing renamed cells:
tests/test_compare.py.)
"""

from __future__ import annotations

import os
import sys

from kit import install_plugin, invoke, one_line_error, suite_dict, tiny_pair, write_suite

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)


def test_validate_warns_of_fewer_than_five_measured_prompts(tmp_path):
    target, draft = tiny_pair(tmp_path)
    suite = suite_dict(target, draft, [{"name": "ar"}])
    suite["datasets"] = [{"name": "wikitext-2", "prompts": 6, "warmup": 2, "L_max": 16}]
    result = invoke("validate", write_suite(tmp_path, suite))
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.stderr.splitlines() if "measured per cell" in line]
    assert line.startswith("warning: dataset wikitext-2: 6 prompts with 2 warmup leave 4 measured per cell")
    assert "raise prompts to 7" in line
    suite["datasets"][0]["prompts"] = 7
    assert "measured per cell" not in invoke("validate", write_suite(tmp_path, suite)).stderr


def test_decoders_shows_a_default_factorys_value():
    result = invoke("decoders")
    assert result.exit_code == 0, result.output
    assert "PydanticUndefined" not in result.output
    assert "extra_body={}" in result.output.replace("\n", "").replace("│", "").replace(" ", "")


PLUGIN = """
from dtbench.api import Decoder, DecoderParams, Step


class P(DecoderParams):
    pass


class Fine(Decoder[P]):
    def generate(self, input_ids, max_new_tokens):
        yield Step((1,))
"""


def test_a_bad_import_time_limit_is_one_line_and_inf_is_no_limit(tmp_path, monkeypatch):
    install_plugin(monkeypatch, tmp_path / "site", "dtbench-fine", {"fine": "dtbench_fine:Fine"}, PLUGIN)
    for bad in ("abc", "0", "-1", "nan"):
        monkeypatch.setenv("DTBENCH_PLUGIN_IMPORT_TIMEOUT", bad)
        one_line_error(invoke("plugins"), "DTBENCH_PLUGIN_IMPORT_TIMEOUT", "not a number of seconds")
    monkeypatch.setenv("DTBENCH_PLUGIN_IMPORT_TIMEOUT", "inf")
    result = invoke("plugins")
    assert result.exit_code == 0, result.output
    assert "fine" in result.output and "failed to load" not in result.output


def test_every_literal_key_form_is_refused():
    """issue 67 item 2: a dict or a list of dicts under a key-like name, and an environment assignment in a launch
    argv, are literal keys; values read from a variable and ordinary settings are not."""
    from dtbench.decoders.engines.params import literal_credential

    assert literal_credential(None, {"api_key": {"x": "sk-LITERAL"}}) == "extra_body.api_key"
    assert literal_credential(None, {"nested": {"token": [{"v": "sk-LITERAL"}]}}) == "extra_body.nested.token"
    env_form = ["env", "API_KEY=sk-LITERAL", "python", "-m", "server"]
    assert literal_credential(None, {}, env_form) == "launch: assignment API_KEY=... in argument 1"
    shell = ["sh", "-c", "export HF_TOKEN='sk-LITERAL' && llama-server --port {port}"]
    assert literal_credential(None, {}, shell) == "launch: assignment HF_TOKEN=... in argument 2"
    fine = ["env", "API_KEY=$KEY", "HF_HOME=/tmp/hf", "llama-server", "--ctx-size=512", "--api-key-file", "k.txt"]
    assert literal_credential(None, {"api_key": {}, "max_tokens": 3, "stop": ["\n"]}, fine) is None


def test_validate_refuses_a_key_in_a_dict_under_a_key_name(tmp_path):
    from test_secrets import TINY  # the embedded model's suite: validate loads no model

    params = {"base_url": "http://127.0.0.1:8000", "extra_body": {"api_key": {"x": "sk-LITERAL"}}}
    suite = write_suite(tmp_path, {**TINY, "decoders": [{"name": "server", "params": params}]})
    line = one_line_error(invoke("validate", suite), "params.extra_body.api_key: a literal credential")
    assert "LITERAL" not in line


LOOPING_FORMAT = """
import pathlib, os
pathlib.Path(os.environ["MARK_IMPORTED"]).write_text("imported")
while True:
    pass
"""


def test_a_run_imports_no_format_plugin(tmp_path, monkeypatch, data_dir):
    """issue 67 item 5: a format plugin looping at import was imported (in a thread left spinning) before the run
    measured, slowing every measurement; `dtbench run` now loads the built-in table renderer only."""
    mark = tmp_path / "imported"
    monkeypatch.setenv("MARK_IMPORTED", str(mark))
    monkeypatch.setenv("DTBENCH_PLUGIN_IMPORT_TIMEOUT", "1")
    entries = {"loopfmt": "dtbench_loopfmt:render"}
    install_plugin(monkeypatch, tmp_path / "site", "dtbench-loopfmt", entries, LOOPING_FORMAT, group="dtbench.formats")
    target, draft = tiny_pair(tmp_path)
    suite = write_suite(tmp_path, suite_dict(target, draft, [{"name": "ar"}]))
    result = invoke("run", suite, "--db", str(tmp_path / "r.db"), "--data-dir", str(data_dir), "--no-progress")
    assert result.exit_code == 0, result.output
    assert "Decoder" in result.stdout  # the report printed, in the built-in table format
    assert not mark.exists(), "the run imported a format plugin"
    assert "loopfmt" not in result.output


def test_the_load_note_counts_the_runs_driver_as_its_own(monkeypatch):
    """issue 67 item 5: in a measuring child, dtbench's own CPU is its driver's tree (the driver's threads are not
    "other processes")."""
    import os

    import psutil

    from dtbench.harness.measurement import load

    monkeypatch.setenv(load.DRIVER_ENV, str(os.getppid()))
    assert load._own_root().pid == os.getppid()
    monkeypatch.setenv(load.DRIVER_ENV, "")
    assert load._own_root().pid == psutil.Process().pid


LOOPING = """
import os
import pathlib

pathlib.Path(os.environ["DTBENCH_LOOP_PID"]).write_text(str(os.getpid()))
while True:  # a plugin that never finishes importing, busy
    pass
"""

EXITING = """
import os

os._exit(3)  # a plugin that ends whatever imports it
"""


def test_an_import_past_its_limit_is_killed_not_left_running(tmp_path, monkeypatch):
    """Issue 67 item 5: before, the import ran on in a daemon thread of the caller (one core busy for the rest of the
    command, a measurement slowed 2x); now it runs in a child process that is killed at the limit, and an import that
    calls ``os._exit`` is that plugin's problem line (before, it ended the caller)."""
    import threading

    import psutil

    pid_file = tmp_path / "pid"
    monkeypatch.setenv("DTBENCH_LOOP_PID", str(pid_file))
    monkeypatch.setenv("DTBENCH_PLUGIN_IMPORT_TIMEOUT", "1")
    site = tmp_path / "site"
    install_plugin(monkeypatch, site, "dtbench-loop", {"loop": "dtbench_loop:X"}, LOOPING)
    install_plugin(monkeypatch, site, "dtbench-quit", {"quit": "dtbench_quit:X"}, EXITING)
    result = invoke("plugins")
    assert result.exit_code == 0, result.output
    problems = [line.strip() for line in result.stdout.splitlines() if "from distribution dtbench-" in line]
    assert (
        "decoder 'loop' from distribution dtbench-loop 0.1 did not finish importing within 1 s (its import ran in a "
        "child process, killed; DTBENCH_PLUGIN_IMPORT_TIMEOUT sets the limit)"
    ) in problems, result.stdout
    assert (
        "decoder 'quit' from distribution dtbench-quit 0.1 failed to load: its import ended the process (exit code 3)"
    ) in problems, result.stdout
    child = int(pid_file.read_text())
    assert child != os.getpid()
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert not [t for t in threading.enumerate() if t.name == "dtbench-plugin"]
    assert "dtbench_loop" not in sys.modules and "dtbench_quit" not in sys.modules
