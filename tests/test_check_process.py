"""The kit trusts nothing it checks (issue 65 items 1 and 2): each planted plugin decoder below fails ``dtbench check``
in its own way (a hang, ``os._exit``, a segfault, ``sys.exit(0)``, ``KeyboardInterrupt`` inside ``generate``, an
ImportError at import, a million printed lines, a 10^5-token Step, rich markup in its name and its error) and each is
that decoder's failure with its reason, the other decoders' verdicts intact, exit 1, no process left behind and
nothing written into the current folder. Also: Ctrl-C leaves no child, a hung check fails a plugin's pytest instead
of hanging it, ``Decoder[P]`` binds its params, and ``dtbench new-decoder`` writes a package that installs and passes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from kit import install_plugin, invoke

from dtbench.cli.check import CHECK_NAMES

TIER = "full"  # tests/conftest.py: child processes, a deadline waited out, a package installed

SLEEP_MARK = "1234.5"  # the argv of the `sleep` a hanging decoder leaves running: found by it, never by chance

PLANTED = """
import ctypes
import os
import subprocess
import sys
import time

from dtbench.api import Decoder, DecoderParams, Step


class P(DecoderParams):
    pass


class Planted(Decoder[P]):
    def act(self):
        pass

    def generate(self, input_ids, max_new_tokens):
        self.act()
        for _ in range(max_new_tokens):
            yield Step((5,))


class Hang(Planted):
    def act(self):
        subprocess.Popen(["sleep", "SLEEP_MARK"], start_new_session=True)  # left behind: must be killed with the child
        while True:
            time.sleep(0.05)


class Exit3(Planted):
    def act(self):
        os._exit(3)


class Segv(Planted):
    def act(self):
        ctypes.string_at(0)


class Exit0(Planted):
    def act(self):
        print("about to call sys.exit(0)")
        sys.exit(0)


class Interrupt(Planted):
    def act(self):
        raise KeyboardInterrupt


class Noisy(Planted):
    noisy = True

    def act(self):
        # a million lines, once per check process, in one write: the check's deadline must not race the printing
        if Noisy.noisy:
            Noisy.noisy = False
            sys.stdout.write("".join(f"noise line {i}\\n" for i in range(1_000_000)))
            sys.stdout.flush()


class BigStep(Planted):
    def generate(self, input_ids, max_new_tokens):
        yield Step(tuple([7] * 100_000), drafted=1, accepted=5)


class Known(Planted):
    xfail_checks = {"greedy_equals_reference": "emits token 5 whatever the prompt (a planted known failure)"}


class Markup(Planted):
    def act(self):
        raise RuntimeError("[link=https://evil.example/]click me[/link] [/] [bold]loud")
""".replace("SLEEP_MARK", SLEEP_MARK)

ENTRIES = {
    "p_hang": "dtbench_planted:Hang",
    "p_exit3": "dtbench_planted:Exit3",
    "p_segv": "dtbench_planted:Segv",
    "p_exit0": "dtbench_planted:Exit0",
    "p_interrupt": "dtbench_planted:Interrupt",
    "p_noisy": "dtbench_planted:Noisy",
    "p_bigstep": "dtbench_planted:BigStep",
    "p_markup": "dtbench_planted:Markup",
    "p_known": "dtbench_planted:Known",
    "p[/]bracket": "dtbench_planted:Planted",
    "p_broken": "dtbench_broken:Nothing",
}


@pytest.fixture
def planted(monkeypatch, tmp_path):
    """The planted decoders installed on sys.path (and PYTHONPATH, for a command's children), a clean cwd, and
    `--all` limited to them and ``ar``."""
    site = tmp_path / "site"
    install_plugin(monkeypatch, site, "dtbench-planted", ENTRIES, PLANTED)
    (site / "dtbench_broken.py").write_text("raise ImportError('no gpu lib here')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    from dtbench.harness import registry

    real = registry.discover
    monkeypatch.setattr(registry, "discover", lambda: {n: e for n, e in real().items() if n in {"ar", *ENTRIES}})
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield cwd
    assert not list(cwd.iterdir()), "dtbench check wrote into the current folder"
    _assert_nothing_left()


def _assert_nothing_left() -> None:
    """No process the checks started is alive: none of this test process's descendants (but multiprocessing's
    resource tracker and fork server, and torch's compile workers: the harness's own, ending with this process), and
    no `sleep` a planted decoder started in a session of its own."""
    deadline = time.monotonic() + 10
    while True:
        left = [
            p
            for p in psutil.Process().children(recursive=True)
            if not any(m in part for part in _cmdline(p) for m in ("resource_tracker", "_inductor", "forkserver"))
        ]
        sleeps = [p for p in psutil.process_iter() if _cmdline(p)[-1:] == [SLEEP_MARK]]
        if not left and not sleeps:
            return
        assert time.monotonic() < deadline, f"left running: {[_cmdline(p) for p in left + sleeps]}"
        time.sleep(0.2)


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_hangs_exits_crashes_and_broken_plugins_are_their_decoders_failures(planted, monkeypatch):
    from dtbench.harness import registry

    names = ["p_hang", "p_exit3", "p_segv", "p_exit0", "p_interrupt", "p_noisy", "p_broken", "ar"]
    planted_only = registry.discover
    monkeypatch.setattr(registry, "discover", lambda: {n: e for n, e in planted_only().items() if n in names})
    result = invoke(
        "check", "--all", "--device", "cpu", "--check", "greedy_equals_reference", "--check", "length",
        "--examples", "2", "--timeout", "8", "--format", "json",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    doc = {r["decoder"]: r for r in json.loads(result.stdout)}
    assert set(names) <= set(doc), sorted(doc)

    def detail(name, check="greedy_equals_reference"):
        (o,) = [o for o in doc[name]["outcomes"] if o["check"] == check]
        assert o["status"] == "failed", o
        return o

    hang = detail("p_hang")
    assert hang["detail"].startswith("exceeded 8 s in greedy_equals_reference"), hang
    assert "process group were killed" in hang["detail"]
    assert "died of exit code 3 in greedy_equals_reference" in detail("p_exit3")["detail"]
    segv = detail("p_segv")
    assert "died of SIGSEGV" in segv["detail"] and "Segmentation fault" in segv["output"], segv
    exit0 = detail("p_exit0")
    assert "died of exit code 0" in exit0["detail"] and "about to call sys.exit(0)" in exit0["output"], exit0
    interrupt = detail("p_interrupt")
    assert "died of exit code 1" in interrupt["detail"] and "KeyboardInterrupt" in interrupt["output"], interrupt
    noisy = detail("p_noisy")
    assert noisy["printed"] >= 1_000_000 and noisy["output"].splitlines()[-1] == "noise line 999999", noisy
    assert len(noisy["output"]) <= 600
    # a crash fails the check it happened in; the decoder's next check ran in a fresh child (and failed the same way)
    assert "died of exit code 3 in length" in detail("p_exit3", "length")["detail"]
    broken = doc["p_broken"]
    assert not broken["ok"] and "failed to load: ImportError: no gpu lib here" in broken["load_error"], broken
    assert doc["ar"]["ok"] and {o["status"] for o in doc["ar"]["outcomes"]} == {"passed"}
    assert result.stdout.count("noise line") <= 2 * 5  # captured: only each check's last lines, never all of it
    assert "noise line" not in result.stderr


def test_a_plugins_text_is_printed_as_text(planted, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich writes escape sequences as on a terminal: a link would be one
    result = invoke(
        "check", "p_markup", "p[/]bracket", "p_bigstep", "--device", "cpu", "--check", "step_accounting",
        "--examples", "1",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    out = result.stdout
    assert "\x1b]8;" not in out  # no OSC 8 hyperlink
    assert "[link=https://evil.example/]click me[/link] [/] [bold]loud" in out  # shown as written
    assert "p[/]bracket" in out
    (big,) = [line for line in out.splitlines() if "counterexample" in line and "7, 7, 7" in line]
    assert 2000 < len(big) < 2300 and "the whole one: --format json" in big  # clipped, on one line (copyable)
    assert len(out) < 20_000
    json_out = invoke(
        "check", "p_bigstep", "--device", "cpu", "--check", "step_accounting", "--examples", "1", "--format", "json"
    )
    (o,) = json.loads(json_out.stdout)[0]["outcomes"]
    assert len(o["counterexample"]["tokens"]) == 100_000  # the whole counterexample


def test_ctrl_c_stops_the_check_and_leaves_no_process(planted):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dtbench.cli.main", "check", "p_hang", "--device", "cpu", "--timeout", "300"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(_cmdline(p)[-1:] == [SLEEP_MARK] for p in psutil.process_iter()):  # the decoder is running
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err


def test_a_hung_check_fails_a_plugins_pytest_instead_of_hanging_it(planted, tmp_path):
    tests = tmp_path / "plugin_tests"
    tests.mkdir()
    (tests / "test_kit.py").write_text(
        textwrap.dedent(
            """
            from dtbench.testing import parametrize_with_checks

            @parametrize_with_checks(["p_hang", "p_exit3", "ar", "p_known"], checks=["greedy_equals_reference"], timeout=8)
            def test_conformance(decoder, check):
                check(decoder)
            """
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tests)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 failed, 1 passed, 1 xfailed" in result.stdout, result.stdout
    assert "exceeded 8 s in greedy_equals_reference" in result.stdout
    assert "died of exit code 3 in greedy_equals_reference" in result.stdout


def test_a_check_leaves_nothing_in_the_temporary_folder(tmp_path):
    """The heads and datastores the declared settings write (medusa, rest), the children's logs and hypothesis
    folders: all gone when `dtbench check` ends. (Each settings lookup once made a scratch folder nobody removed:
    thousands of them in /tmp after a day of runs.)"""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dtbench.cli.main", "check", "medusa", "rest", "--device", "cpu"]
    check = subprocess.run(
        [*cmd, "--check", "greedy_equals_reference", "--check", "length", "--examples", "2", "--format", "json"],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    statuses = {(r["decoder"], o["check"]): o["status"] for r in json.loads(check.stdout) for o in r["outcomes"]}
    assert statuses == {(d, c): "passed" for d in ("medusa", "rest") for c in ("greedy_equals_reference", "length")}
    left = sorted(p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_"))  # a cache, kept
    assert left == []


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_a_new_decoder_package_installs_and_passes_the_kit(tmp_path, kind):
    """`dtbench new-decoder` writes a package that installs with pip and passes `dtbench check` as generated (every
    check), and whose own tests run the kit through parametrize_with_checks."""
    name = f"fresh_{kind}"
    result = invoke("new-decoder", name, f"--{kind}", "--dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    package = tmp_path / f"dtbench-fresh-{kind}"
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site)]
    subprocess.run([*pip, str(package)], check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    # every check for the chain; the tree's compile and sampling law (25 s more here) were run once by hand
    # (issue 65's closing note): the chain's run shows the package's compiled and sampled paths
    skip = () if kind == "chain" else ("compiled_equals_eager", "sampling")
    chosen = [f"--check={c}" for c in CHECK_NAMES if c not in skip]
    check = subprocess.run(
        [sys.executable, "-m", "dtbench.cli.main", "check", name, "--device", "cpu", "--format", "json", *chosen],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    (report,) = json.loads(check.stdout)
    statuses = {o["check"]: o["status"] for o in report["outcomes"]}
    assert (
        statuses["greedy_equals_reference"]
        == statuses["length"]
        == statuses["batch_rows" if kind == "tree" else "eos"]
        == "passed"
    ), statuses
    if kind == "chain":
        assert statuses["compiled_equals_eager"] == statuses["sampling"] == "passed", statuses
    own = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "greedy or eos", str(package / "tests")],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert own.returncode == 0 and "2 passed" in own.stdout, own.stdout + own.stderr


def test_new_decoder_refuses_bad_names_in_one_line(tmp_path):
    from kit import one_line_error

    one_line_error(invoke("new-decoder", "ar", "--dir", str(tmp_path)), "built-in decoder's name")
    one_line_error(invoke("new-decoder", "Bad-Name", "--dir", str(tmp_path)), "not a lowercase identifier")
    assert invoke("new-decoder", "twice", "--dir", str(tmp_path)).exit_code == 0
    one_line_error(invoke("new-decoder", "twice", "--dir", str(tmp_path)), "exists already")
