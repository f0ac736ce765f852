"""The conformance kit (issue 56): named checks that hold any decoder, built-in or third-party, to what dtbench's own
decoders are held to. Same stability promise as :mod:`dtbench.api`: the names in ``__all__`` keep their meaning
across minor versions.

Which checks apply follows from what a decoder declares, never from its name; its params come from its
:meth:`~dtbench.api.Decoder.check_settings`. The checks (:data:`CHECKS`, in the order they run):

- ``state``: a prompt decoded after others (the same decoder reused, a new one made after) equals a fresh decoder's.
- ``greedy_equals_reference`` (``lossless``): hypothesis over prompts, T, params, Llama and GPT-NeoX pairs, drafts
  accepting all / some / almost nothing, with and without an EOS; token for token in float32/float64, under the
  tie-aware rule (docs/lossless.md) in float16/bfloat16.
- ``batch_rows`` (``batching``): at B = 2..4, ragged prompts, rows ending early, each row equals its prompt alone.
- ``step_accounting``: every Step commits a token, ``accepted <= depth <= drafted``, forward counts consistent.
- ``host_reads``: device-to-host reads per iteration within ``host_reads_bound`` (reported when none is declared).
- ``compiled_equals_eager`` (``compiles``): the compile step's buckets only, zero recompiles, same tokens as eager;
  at B = 1 and, for a decoder that batches, at B = 3 over T = 32..40 (each way a chain of K <= 8 ends).
- ``sampling`` (``supports_sampling``): a chi-square test of sampled outputs against the target's distribution.

In a plugin's own tests (what ``examples/dtbench-prompt-lookup/tests`` does)::

    from dtbench.testing import parametrize_with_checks

    @parametrize_with_checks(["prompt_lookup"])
    def test_conformance(decoder, check):
        check(decoder)

From the command line: ``dtbench check NAME`` (``--all`` for every registered decoder).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from dtbench.core import DtbenchError
from dtbench.testing.checks import CHECKS, FAILING, Check, Outcome, apply_xfail, run_check
from dtbench.testing.common import PRECISIONS, CheckContext, CheckFailed, Precision, precisions, resolve
from dtbench.testing.process import DEFAULT_TIMEOUT_S, DEFAULT_TIMEOUTS, CheckProcess, ChildDied, timeout_of

__all__ = [
    "CHECKS",
    "DEFAULT_TIMEOUTS",
    "DEFAULT_TIMEOUT_S",
    "CheckContext",
    "CheckFailed",
    "Outcome",
    "Report",
    "check_decoder",
    "check_names",
    "parametrize_with_checks",
    "resolve",
]


def check_names() -> list[str]:
    """The names of every check, in the order they run."""
    return [c.name for c in CHECKS]


def _checks(names: Iterable[str] | None) -> list[Check]:
    if names is None:
        return list(CHECKS)
    wanted = list(names)
    unknown = [n for n in wanted if n not in check_names()]
    if unknown:
        raise DtbenchError(f"unknown check {', '.join(unknown)}: choose from {', '.join(check_names())}")
    return [c for c in CHECKS if c.name in wanted]


@dataclass
class Report:
    """Every outcome of one decoder: ``ok`` when none failed, errored or passed a declared known failure (xpass);
    ``verdicts`` the one-line failures; ``load_error`` why the decoder could not be loaded ("" when it loaded)."""

    decoder: str
    outcomes: list[Outcome] = field(default_factory=list)
    load_error: str = ""

    @property
    def ok(self) -> bool:
        return not self.load_error and all(o.status not in FAILING for o in self.outcomes)

    @property
    def verdicts(self) -> list[str]:
        lines = [f"{self.decoder}: failed to load: {self.load_error}"] if self.load_error else []
        return lines + [o.verdict for o in self.outcomes if o.status in FAILING]


ISOLATIONS = ("process", "none")
NONDETERMINISTIC = (
    "not run: the decoder is nondeterministic at this precision (deterministic failed), so a failure here "
)
NONDETERMINISTIC += "would blame something else"


def check_decoder(
    decoder: str | type,
    *,
    device: str = "cpu",
    examples: int | None = None,
    checks: Iterable[str] | None = None,
    progress: Callable[[Outcome], None] | None = None,
    timeout: float | None = None,
    isolation: str = "process",
) -> Report:
    """Run the named checks on one decoder, by default in a child process under deadlines (issue 65).

    Args:
        decoder: a registered name (built-in or an entry point's) or a Decoder subclass (defined at module level:
            the child imports it by name).
        device: ``auto``, ``cpu``, ``cuda`` or a comma list of precisions (``cpu``, ``cpu-bfloat16``, ``cuda``,
            ``cuda-float16``).
        examples: hypothesis examples per check (None: each check's default, capped by
            ``$DTBENCH_HYPOTHESIS_EXAMPLES``).
        checks: check names to run (None: all).
        progress: called with each outcome as it finishes.
        timeout: seconds each check may run (None: :data:`DEFAULT_TIMEOUTS`, else :data:`DEFAULT_TIMEOUT_S`);
            a check past it fails and its child is killed with its process group.
        isolation: ``process`` (the default: the decoder's checks run in a child process; a hang, an exit or a
            crash is the failure of the check it happened in, and the remaining checks go on in a fresh child) or
            ``none`` (in this process: no deadline, and a crash ends the caller; for debugging).

    Returns:
        the decoder's :class:`Report`; a decoder that fails to load is a report with ``load_error`` set.

    Raises:
        DtbenchError: an unknown decoder name, check, device or isolation; a class that cannot be sent to a child.
    """
    if isolation not in ISOLATIONS:
        raise DtbenchError(f"unknown isolation {isolation!r}: use {' or '.join(ISOLATIONS)}")
    if timeout is not None and not timeout > 0:
        raise DtbenchError(f"timeout must be a number of seconds > 0, not {timeout!r}")
    chosen = _checks(checks)
    precs = precisions(device)
    if isolation == "none":
        name, cls = resolve(decoder)
        report = Report(name)
        _plan(report, chosen, precs, progress, lambda c, p: run_check(c, cls, name, p, examples), cls.xfail_checks)
        return report
    label = _label(decoder)
    if isinstance(decoder, str):
        _known_name(decoder)
    report = Report(label)
    child: CheckProcess | None = None
    xfail: dict[str, str] = {}

    def start() -> CheckProcess:
        nonlocal xfail
        proc = CheckProcess()
        try:
            error = proc.load(decoder)
        except ChildDied as exc:
            error = exc.reason + (f"; output: {exc.output}" if exc.output else "")
        except BaseException:
            proc.close()
            raise
        if error is not None:
            proc.close()
            raise _LoadFailed(error)
        report.decoder, xfail = proc.name or label, proc.xfail_checks
        return proc

    def one(check: Check, precision: Precision) -> Outcome:
        nonlocal child
        if child is None:
            child = start()
        try:
            return Outcome(**child.run(check.name, precision.name, examples, timeout_of(check.name, timeout)))
        except ChildDied as exc:
            child.close()
            child = None
            return Outcome(
                report.decoder, check.name, precision.name, "failed", exc.reason, output=exc.output, printed=exc.printed
            )

    try:
        _plan(report, chosen, precs, progress, one, lambda: xfail)
    except _LoadFailed as exc:
        report.load_error = str(exc)
    finally:
        if child is not None:
            child.close()
    return report


class _LoadFailed(Exception):
    pass


def _label(decoder: str | type) -> str:
    return decoder if isinstance(decoder, str) else getattr(decoder, "__name__", str(decoder))


def _known_name(name: str) -> None:
    """An unknown decoder name is bad input (a one-line error, exit 2), checked from the entry points' metadata
    without importing anything: a broken plugin's import is its child's to fail."""
    from dtbench.harness import registry

    found = registry.DECODERS.scan()
    if name not in found.entries and name not in found.ambiguous:
        registry.get(name)  # the registry's one-line error, with the closest names


def _plan(
    report: Report,
    chosen: list[Check],
    precs: list[Precision],
    progress: Callable[[Outcome], None] | None,
    run: Callable[[Check, Precision], Outcome],
    xfail: Any,
) -> None:
    """The checks in order at every precision, each outcome (under the decoder's declared known failures) appended to
    ``report`` as it finishes; after a ``deterministic`` failure the precision's other checks are ``skipped``."""
    for precision in precs:
        nondeterministic = False
        for check in chosen:
            if nondeterministic:
                outcome = Outcome(report.decoder, check.name, precision.name, "skipped", NONDETERMINISTIC)
            else:
                t0 = time.perf_counter()
                outcome = run(check, precision)
                outcome.seconds = outcome.seconds or time.perf_counter() - t0
                apply_xfail(outcome, xfail() if callable(xfail) else xfail)
                nondeterministic = check.name == "deterministic" and outcome.status == "failed"
            report.outcomes.append(outcome)
            if progress is not None:
                progress(outcome)


class _Bound:
    """What ``parametrize_with_checks`` passes as ``check``: calling it on the decoder runs the check (in a child
    process shared by the test session's checks, replaced when one dies or is killed) and fails the test with the
    one-line verdict and the counterexample (a skip when the check does not apply, an xfail for a declared known
    failure, a failure for a declared one that passes)."""

    def __init__(self, check: Check, precision: Precision, examples: int | None, timeout: float | None, isolation: str):
        self.check, self.precision, self.examples = check, precision, examples
        self.timeout, self.isolation = timeout, isolation

    def __call__(self, decoder: str | type) -> Outcome:
        import pytest

        outcome = self.outcome(decoder)
        shown = _shown_output(outcome)
        if outcome.status == "n/a":
            pytest.skip(outcome.detail)
        if outcome.status == "xfail":
            pytest.xfail(outcome.detail)
        if outcome.status in FAILING:
            pytest.fail(f"{outcome.verdict}\ncounterexample: {outcome.counterexample}{shown}", pytrace=False)
        return outcome

    def outcome(self, decoder: str | type) -> Outcome:
        if self.isolation == "none":
            name, cls = resolve(decoder)
            return apply_xfail(run_check(self.check, cls, name, self.precision, self.examples), cls.xfail_checks)
        child = _session_child(decoder)
        try:
            data = child.run(
                self.check.name, self.precision.name, self.examples, timeout_of(self.check.name, self.timeout)
            )
            return apply_xfail(Outcome(**data), child.xfail_checks)
        except ChildDied as exc:
            _drop_session_child()
            return apply_xfail(
                Outcome(child.name, self.check.name, self.precision.name, "failed", exc.reason, output=exc.output),
                child.xfail_checks,
            )

    def __repr__(self) -> str:
        return f"{self.check.name}[{self.precision.name}]"


def _shown_output(outcome: Outcome) -> str:
    return f"\nlast output ({outcome.printed} lines):\n{outcome.output}" if outcome.output else ""


_SESSION: list[CheckProcess] = []  # the child parametrize_with_checks' tests share (one per test process)


def _session_child(decoder: str | type) -> CheckProcess:
    """The test session's child with ``decoder`` loaded: started on first use, replaced after a crash or a kill.

    Raises:
        pytest's Failed: the decoder fails to load (the test fails with the reason)."""
    import atexit

    import pytest

    if _SESSION and not _SESSION[0].proc.is_alive():
        _drop_session_child()
    if not _SESSION:
        _SESSION.append(CheckProcess())
        if len(_SESSION) == 1:
            atexit.register(_drop_session_child)
    child = _SESSION[0]
    if child.decoder is not decoder and child.decoder != decoder:
        try:
            error = child.load(decoder)
        except ChildDied as exc:
            _drop_session_child()
            error = exc.reason
        if error is not None:
            pytest.fail(f"{_label(decoder)}: failed to load: {error}", pytrace=False)
    return child


def _drop_session_child() -> None:
    while _SESSION:
        _SESSION.pop().close()


def parametrize_with_checks(
    decoders: Iterable[str | type],
    *,
    devices: Iterable[str] = ("cpu",),
    checks: Iterable[str] | None = None,
    examples: int | None = None,
    timeout: float | None = None,
    isolation: str = "process",
) -> Any:
    """A ``pytest.mark.parametrize`` over decoder x check x precision: one test id per ``decoder-check-precision``
    (``pytest -k greedy`` selects one check, ``-k cuda`` the GPU's). CUDA precisions are skipped without a GPU.

    The checks run in a child process the session's tests share (``isolation="process"``, the default): a check
    that hangs past its deadline, or a decoder that exits or crashes, fails that test id and the next test gets a
    fresh child; pytest itself never hangs or dies. ``isolation="none"`` runs them in the test's own process.

    Args:
        decoders: registered names or Decoder subclasses (at module level, for the child to import).
        devices: precision names (:data:`~dtbench.testing.common.PRECISIONS`).
        checks: check names (None: all); examples, timeout: as :func:`check_decoder`.
    """
    import pytest
    import torch

    if isolation not in ISOLATIONS:
        raise DtbenchError(f"unknown isolation {isolation!r}: use {' or '.join(ISOLATIONS)}")
    params = []
    for decoder in decoders:
        label = _label(decoder)
        for device in devices:
            if device not in PRECISIONS:
                raise DtbenchError(f"unknown device {device}: use {', '.join(PRECISIONS)}")
            precision = PRECISIONS[device]
            marks = []
            if precision.device == "cuda":
                marks.append(pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))
            for check in _checks(checks):
                bound = _Bound(check, precision, examples, timeout, isolation)  # ids end in the device: `-k cuda`
                params.append(pytest.param(decoder, bound, id=f"{label}-{check.name}-{device}", marks=marks))
    return pytest.mark.parametrize("decoder, check", params)
