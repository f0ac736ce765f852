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

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from dtbench.core import DtbenchError
from dtbench.harness.conformance import PRECISIONS, CheckContext, CheckFailed, Precision, precisions
from dtbench.harness.conformance_checks import CHECKS, Check, Outcome, run_check

__all__ = [
    "CHECKS",
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


def resolve(decoder: str | type) -> tuple[str, type]:
    """(name, class) of a registered decoder name or a Decoder subclass.

    Raises:
        DtbenchError: an unknown name (the registry's one-line message), or a class that is not a Decoder.
    """
    from dtbench.decoders.base import Decoder
    from dtbench.harness import registry

    if isinstance(decoder, str):
        return decoder, registry.get(decoder)
    if isinstance(decoder, type) and issubclass(decoder, Decoder):
        return decoder.__name__, decoder
    raise DtbenchError(f"not a decoder: {decoder!r} (give a registered name or a Decoder subclass)")


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
    """Every outcome of one decoder: ``ok`` when none failed or errored; ``verdicts`` the one-line failures."""

    decoder: str
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(o.status not in ("failed", "error") for o in self.outcomes)

    @property
    def verdicts(self) -> list[str]:
        return [o.verdict for o in self.outcomes if o.status in ("failed", "error")]


def check_decoder(
    decoder: str | type,
    *,
    device: str = "cpu",
    examples: int | None = None,
    checks: Iterable[str] | None = None,
    progress: Callable[[Outcome], None] | None = None,
) -> Report:
    """Run the named checks on one decoder.

    Args:
        decoder: a registered name (built-in or an entry point's) or a Decoder subclass.
        device: ``auto``, ``cpu``, ``cuda`` or a comma list of precisions (``cpu``, ``cpu-bfloat16``, ``cuda``,
            ``cuda-float16``).
        examples: hypothesis examples per check (None: each check's default, capped by
            ``$DTBENCH_HYPOTHESIS_EXAMPLES``).
        checks: check names to run (None: all).
        progress: called with each outcome as it finishes.

    Returns:
        the decoder's :class:`Report`.

    Raises:
        DtbenchError: an unknown decoder, check or device.
    """
    name, cls = resolve(decoder)
    report = Report(name)
    for precision in precisions(device):
        for check in _checks(checks):
            outcome = run_check(check, cls, name, precision, examples)
            report.outcomes.append(outcome)
            if progress is not None:
                progress(outcome)
    return report


class _Bound:
    """What ``parametrize_with_checks`` passes as ``check``: calling it on the decoder runs the check and fails the
    test with the one-line verdict and the counterexample (a skip when the check does not apply)."""

    def __init__(self, check: Check, precision: Precision, examples: int | None):
        self.check, self.precision, self.examples = check, precision, examples

    def __call__(self, decoder: str | type) -> Outcome:
        import pytest

        name, cls = resolve(decoder)
        outcome = run_check(self.check, cls, name, self.precision, self.examples)
        if outcome.status == "n/a":
            pytest.skip(outcome.detail)
        if outcome.status in ("failed", "error"):
            pytest.fail(f"{outcome.verdict}\ncounterexample: {outcome.counterexample}", pytrace=False)
        return outcome

    def __repr__(self) -> str:
        return f"{self.check.name}[{self.precision.name}]"


def parametrize_with_checks(
    decoders: Iterable[str | type],
    *,
    devices: Iterable[str] = ("cpu",),
    checks: Iterable[str] | None = None,
    examples: int | None = None,
) -> Any:
    """A ``pytest.mark.parametrize`` over decoder x check x precision: one test id per ``decoder-check-precision``
    (``pytest -k greedy`` selects one check, ``-k cuda`` the GPU's). CUDA precisions are skipped without a GPU.

    Args:
        decoders: registered names or Decoder subclasses.
        devices: precision names (:data:`~dtbench.harness.conformance.PRECISIONS`).
        checks: check names (None: all); examples: as :func:`check_decoder`.
    """
    import pytest
    import torch

    params = []
    for decoder in decoders:
        label = decoder if isinstance(decoder, str) else getattr(decoder, "__name__", str(decoder))
        for device in devices:
            if device not in PRECISIONS:
                raise DtbenchError(f"unknown device {device}: use {', '.join(PRECISIONS)}")
            precision = PRECISIONS[device]
            marks = []
            if precision.device == "cuda":
                marks.append(pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))
            for check in _checks(checks):
                bound = _Bound(check, precision, examples)  # ids end in the device: `-k cuda` selects the GPU's
                params.append(pytest.param(decoder, bound, id=f"{label}-{check.name}-{device}", marks=marks))
    return pytest.mark.parametrize("decoder, check", params)
