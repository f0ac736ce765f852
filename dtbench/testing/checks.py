"""The named conformance checks (issue 56), each a function of a :class:`Job` (one decoder at one precision), and
the runner that turns a check into an :class:`Outcome`. Public through :mod:`dtbench.testing`.

Which checks apply follows from what a decoder declares (``lossless``/``lossless_with``, ``batching``/
``batching_error``, ``compiles``/``compile_error``, ``supports_sampling``/``sampling_error``, ``requests``,
``host_reads_bound``), never from its name; the params come from its ``check_settings``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dtbench.core import DtbenchError
from dtbench.decoders.base import Decoder, DecoderParams
from dtbench.decoders.cut import cut_tokens
from dtbench.testing import contract
from dtbench.testing.common import (
    ARCHS,
    DRAFT_KINDS,
    FLAT,
    SHARPNESS,
    CheckContext,
    CheckFailed,
    NotApplicable,
    Precision,
    build,
    collect,
    collect_rows,
    compare,
    describe,
    distinct_rows,
    examples,
    pair,
    pairs_space,
    prompts,
    reference_tokens,
    search,
    settings_of,
)
from dtbench.testing.compiled import compiled_equals_eager


@dataclass
class Job:
    """One decoder class at one precision, as the checks see it.

    Attributes:
        cls: the decoder class; name: its registered name (or class name); precision: where it runs;
        asked: ``--examples`` (None: each check's default); notes: what a passing check reports (counts).
    """

    cls: type[Decoder[Any]]
    name: str
    precision: Precision
    asked: int | None = None
    reported: bool = False
    notes: list[str] = field(default_factory=list)

    def target(self) -> torch.nn.Module:
        return pair("llama", "self", FLAT, self.precision)[0]

    def settings(self) -> Any:
        """The declared settings for the tiny targets (every tiny pair shares vocabulary and hidden size)."""
        return _settings(self.cls, self.precision)

    def params(self, keep: Callable[[DecoderParams], str | None]) -> Any:
        """A strategy over the declared settings that ``keep`` has no reason against.

        Raises:
            NotApplicable: no declared setting is kept (the first reason).
        """
        from hypothesis import strategies as st

        declared = self.settings()
        if not isinstance(declared, list):
            return declared.filter(lambda p: keep(p) is None)
        kept = [p for p in declared if keep(p) is None]
        if not kept:
            raise NotApplicable(keep(declared[0]) if declared else "declares no check settings")
        return st.sampled_from(kept)

    def examples(self, default: int) -> int:
        return examples(default, self.asked)


_CONTEXTS: dict[int, CheckContext] = {}


def _settings(cls: type[Decoder[Any]], precision: Precision) -> Any:
    target = pair("llama", "self", FLAT, precision)[0]
    if id(target) not in _CONTEXTS:  # (setdefault would make a scratch folder on every call)
        _CONTEXTS[id(target)] = CheckContext(target)
    ctx = _CONTEXTS[id(target)]
    return settings_of(cls, ctx)


def _lossless(cls: type[Decoder[Any]]) -> Callable[[DecoderParams], str | None]:
    return lambda p: None if cls.lossless_with(p) else "declares lossless = False (lossless_with these params)"


def _eos(full: list[int], eos_at: int | None) -> frozenset[int]:
    return frozenset() if eos_at is None or not full else frozenset({full[eos_at % len(full)]})


def _st() -> Any:
    from hypothesis import strategies as st

    return st


# --- the checks -------------------------------------------------------------------------------------------------------


def greedy_equals_reference(job: Job) -> None:
    """Greedy output equals the reference (the target's own greedy tokens for an ``ar``-referenced decoder): hypothesis
    over prompts, T, the declared params, Llama and GPT-NeoX pairs, drafts accepting all/some/almost nothing, flat and
    sharp output layers, with and without stopping at an EOS; token for token, or tie-aware at low precision."""
    st, cls = _st(), job.cls
    params = job.params(_lossless(cls))

    def body(prompt, T, arch, kind, sharpness, params, eos_at):
        target, draft = pair(arch, kind, sharpness, job.precision)
        full = reference_tokens(cls, params, target, draft, prompt, T, frozenset())
        eos = _eos(full, eos_at)
        expected = cut_tokens(full, T, eos)
        decoder = build(cls, params, target, draft)
        decoder.eos_token_id = next(iter(eos)) if eos else None
        output = collect(decoder, prompt, T)
        diff = compare(job.precision, target, prompt, output, expected)
        if diff:
            shown = {"arch": arch, "draft": kind, "sharpness": sharpness, "prompt": prompt, "T": T}
            raise CheckFailed(
                f"differs from the reference at position {diff.get('position')}: "
                f"expected {diff.get('expected')}, got {diff.get('got')}",
                {**shown, "params": describe(params), "eos": sorted(eos) or None, **diff},
            )

    strategies = {**pairs_space(params), "eos_at": st.none() | st.integers(0, 39)}
    search(job.examples(20), strategies, body)


def batch_rows(job: Job) -> None:
    """At B = 2..5 (ragged prompts, rows ending early at an EOS; Llama and GPT-NeoX pairs, every kind of draft) every
    row equals that prompt decoded alone by the same decoder."""
    st, cls = _st(), job.cls
    if not cls.batching:
        raise NotApplicable("declares batching = False")
    params = job.params(lambda p: cls.batching_error(p))

    def body(rows, T, arch, kind, sharpness, params, eos_at):
        target, draft = pair(arch, kind, sharpness, job.precision)
        alone_full = [collect(build(cls, params, target, draft), p, T) for p in rows]
        eos = _eos(alone_full[0], eos_at)
        alone = [cut_tokens(a, T, eos) for a in alone_full]
        decoder = build(cls, params, target, draft)
        decoder.eos_token_id = next(iter(eos)) if eos else None
        batched = collect_rows(decoder, rows, T)
        for r, (out, exp) in enumerate(zip(batched, alone)):
            others = [p for i, p in enumerate(rows) if i != r]
            diff = compare(job.precision, target, rows[r], out, exp, companions=others)
            if diff:
                raise CheckFailed(
                    f"row {r} of B = {len(rows)} differs from its prompt decoded alone at position "
                    f"{diff.get('position')}: expected {diff.get('expected')}, got {diff.get('got')}",
                    {
                        "rows": rows,
                        "row": r,
                        "T": T,
                        "draft": kind,
                        "params": describe(params),
                        "eos": sorted(eos) or None,
                        **diff,
                    },
                )

    strategies = {
        "rows": distinct_rows(2, 5, 16),
        "T": st.integers(1, 24),
        "arch": st.sampled_from(ARCHS),
        "kind": st.sampled_from(DRAFT_KINDS),
    }
    strategies |= {"sharpness": st.sampled_from(SHARPNESS), "params": params}
    search(job.examples(8), {**strategies, "eos_at": st.none() | st.integers(0, 23)}, body)


def step_accounting(job: Job) -> None:
    """Every Step commits at least one token, ``0 <= accepted <= depth <= drafted``, ``accepted <= len(tokens) <=
    accepted + 1``; as the runner counts (hooks on the target and the draft), every Step ran a target forward and,
    after the first, fed the target at least ``drafted + 1`` tokens."""
    from dtbench.harness.measurement.measure import measure

    st, cls = _st(), job.cls

    def body(prompt, T, kind, params, eos_at):
        target, draft = pair("llama", kind, FLAT, job.precision)
        full = collect(build(cls, params, target, draft), prompt, T)
        eos = _eos(full, eos_at)
        decoder = build(cls, params, target, draft)
        decoder.eos_token_id = next(iter(eos)) if eos else None
        shown = {"prompt": prompt, "T": T, "draft": kind, "params": describe(params), "eos": sorted(eos) or None}
        try:
            m = measure(decoder, prompt, T, torch.device(job.precision.device))
        except DtbenchError as exc:
            raise CheckFailed(str(exc), shown) from None
        for i, (s, r) in enumerate(zip(m.steps, m.records)):
            problem = _step_problem(i, s, r)
            if problem:
                raise CheckFailed(
                    f"Step {i} {problem}",
                    {
                        **shown,
                        "step": i,
                        "tokens": list(s.tokens),
                        "drafted": s.drafted,
                        "accepted": s.accepted,
                        "depth": s.depth,
                    },
                )

    strategies = {"prompt": prompts(), "T": st.integers(1, 32), "kind": st.sampled_from(DRAFT_KINDS)}
    search(
        job.examples(10),
        {**strategies, "params": job.params(lambda p: None), "eos_at": st.none() | st.integers(0, 31)},
        body,
    )


def _step_problem(i: int, s: Any, r: Any) -> str | None:
    n = len(s.tokens)
    if n == 0:
        return "commits no token"
    if not 0 <= s.accepted <= s.drafted:
        return f"reports accepted = {s.accepted} of drafted = {s.drafted}"
    if not 0 <= s.depth <= s.drafted:
        return f"reports depth = {s.depth} of drafted = {s.drafted}"
    if s.accepted > max(s.depth, 0) and s.depth:
        return f"reports accepted = {s.accepted} beyond depth = {s.depth}"
    if not s.accepted <= n <= s.accepted + 1:
        return f"commits {n} tokens for accepted = {s.accepted} (accepted drafts plus at most one token)"
    if r.target_forwards < 1:
        return "ran no target forward (every Step is one target verification)"
    if i > 0 and r.target_tokens < s.drafted + 1:
        return f"fed the target {r.target_tokens} tokens for {s.drafted} drafted (at least drafted + 1)"
    return None


def host_reads(job: Job) -> None:
    """Device-to-host reads per iteration within the bound the decoder declares (``host_reads_bound``); without a
    declared bound the counts are reported, not judged."""
    from dtbench.harness.measurement.host_reads import reads_per_iteration

    st, cls = _st(), job.cls
    seen: list[int] = []

    def body(prompt, T, params):
        target, draft = pair("llama", "perturbed", FLAT, job.precision)
        counts = reads_per_iteration(build(cls, params, target, draft), prompt, T, torch.device(job.precision.device))
        steps = _steps(build(cls, params, target, draft), prompt, T)
        for i, (reads, step) in enumerate(zip(counts["host_reads"], steps)):
            bound = cls.host_reads_bound(params, step)
            seen.append(reads)
            if bound is None:
                job.reported = True
            elif reads > bound:
                raise CheckFailed(
                    f"iteration {i} made {reads} host reads, above its declared bound {bound}",
                    {
                        "prompt": prompt,
                        "T": T,
                        "params": describe(params),
                        "iteration": i,
                        "per_iteration": counts["host_reads"],
                    },
                )

    search(
        job.examples(3), {"prompt": prompts(2, 24), "T": st.integers(8, 32), "params": job.params(lambda p: None)}, body
    )
    job.notes.append(f"at most {max(seen, default=0)} reads per iteration")


def _steps(decoder: Decoder[Any], prompt: list[int], T: int) -> list[Any]:
    from dtbench.testing.common import device_of

    steps, n = [], 0
    gen: Any = decoder.generate(torch.tensor([prompt], device=device_of(decoder)), T)
    for step in gen:
        steps.append(step)
        n += len(step.tokens)
        if n >= T:
            break
    gen.close()
    return steps


def state(job: Job) -> None:
    """Nothing leaks across prompts or instances: a prompt decoded after two others by the same decoder, and by a new
    decoder made after them, gives what a new decoder gives on it first."""
    st, cls = _st(), job.cls

    def body(a, b, c, T, kind, params):
        target, draft = pair("llama", kind, FLAT, job.precision)
        first = collect(build(cls, params, target, draft), a, T)
        reused = build(cls, params, target, draft)
        for p in (b, c):
            collect(reused, p, T)
        for how, out in (
            ("the same decoder after two other prompts", collect(reused, a, T)),
            ("a new decoder made after them", collect(build(cls, params, target, draft), a, T)),
        ):
            diff = compare(job.precision, target, a, out, first)
            if diff:
                raise CheckFailed(
                    f"{how} differs from a fresh decoder at position {diff.get('position')}: "
                    f"fresh {diff.get('expected')}, now {diff.get('got')}",
                    {"prompts": [a, b, c], "T": T, "draft": kind, "params": describe(params), **diff},
                )

    strategies = {
        "a": prompts(),
        "b": prompts(),
        "c": prompts(),
        "T": st.integers(1, 32),
        "kind": st.sampled_from(DRAFT_KINDS),
    }
    search(job.examples(4), {**strategies, "params": job.params(lambda p: None)}, body)


@dataclass(frozen=True)
class Check:
    """A named check: ``run`` raises :class:`CheckFailed` (a defect), :class:`NotApplicable` (with the declaration
    that rules it out) or returns (passed)."""

    name: str
    run: Callable[[Job], None]

    @property
    def summary(self) -> str:
        return (self.run.__doc__ or "").split("\n\n")[0].replace("\n", " ")


def _sampling(job: Job) -> None:
    from dtbench.testing.sampling import sampling

    sampling(job)


_sampling.__doc__ = """A sampled decoder's outputs follow the target's processed distribution: the first 3 tokens of
1,000 seeded generations against their exact law by enumeration, a chi-square test at alpha = 1e-4, drafts
accepted and rejected."""

CHECKS: tuple[Check, ...] = (
    Check("deterministic", contract.deterministic),  # first: a nondeterministic decoder is named as such (issue 65)
    Check("state", state),  # before the others: a fresh class state is what it compares against
    Check("greedy_equals_reference", greedy_equals_reference),
    Check("length", contract.length),
    Check("eos", contract.eos),
    Check("inputs_unchanged", contract.inputs_unchanged),
    Check("batch_rows", batch_rows),
    Check("step_accounting", step_accounting),
    Check("host_reads", host_reads),
    Check("compiled_equals_eager", compiled_equals_eager),
    Check("sampling", _sampling),
)
"""Every check, in the order they run (``dtbench check --check NAME`` picks some)."""


FAILING = ("failed", "error", "xpass")  # the statuses that fail a decoder (exit 1)


@dataclass
class Outcome:
    """One check's result.

    Attributes:
        status: ``passed`` | ``failed`` | ``n/a`` (with the declaration that rules it out) | ``reported`` (counts
            shown, nothing declared to judge) | ``error`` (the kit itself could not run it) | ``xfail`` (failed, and
            the decoder declares it a known failure: ``xfail_checks``) | ``xpass`` (declared a known failure and
            passed: a failure, as pytest's strict xfail) | ``skipped`` (not run: the decoder failed
            ``deterministic`` at this precision, so another check's failure would blame the wrong thing).
        detail: the one-line reason; counterexample: the failing inputs; seconds: wall time of the check.
        output: the last lines the decoder printed during the check (escaped), "" when it printed nothing;
        printed: how many lines it printed (:mod:`dtbench.testing.process` captures them).
    """

    decoder: str
    check: str
    precision: str
    status: str
    detail: str = ""
    counterexample: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    output: str = ""
    printed: int = 0

    @property
    def verdict(self) -> str:
        """The one line a failure prints: decoder, check, precision and reason."""
        return f"{self.decoder}: {self.check} {self.status} on {self.precision}: {self.detail}"


def run_check(
    check: Check, cls: type[Decoder[Any]], name: str, precision: Precision, asked: int | None = None
) -> Outcome:
    """Run one check on one decoder class at one precision; never raises for the decoder's defects."""
    t0 = time.perf_counter()
    job = Job(cls, name, precision, asked)
    out = Outcome(name, check.name, precision.name, "passed")
    try:
        if cls.requests:
            raise NotApplicable("declares requests = True (measured through a server; no forward runs in this process)")
        check.run(job)
        if job.reported:
            out.status = "reported"
        out.detail = "; ".join(job.notes)
    except NotApplicable as exc:
        out.status, out.detail = "n/a", str(exc)
    except CheckFailed as exc:
        out.status, out.detail, out.counterexample = "failed", exc.message, exc.counterexample
    except DtbenchError as exc:
        out.status, out.detail = "error", str(exc)
    except Exception as exc:  # the kit's own failure (or a declaration it cannot use): one line, never a traceback
        out.status, out.detail = "error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    out.seconds = time.perf_counter() - t0
    return out


def known_failure(xfail_checks: Any, check: str, precision: str) -> tuple[str, str] | None:
    """(key, reason) when a decoder's ``xfail_checks`` declares ``check`` a known failure at ``precision`` (the key
    ``"check[precision]"`` before ``"check"``), else None."""
    declared = dict(xfail_checks or {})
    for key in (f"{check}[{precision}]", check):
        if key in declared:
            return key, str(declared[key])
    return None


def apply_xfail(outcome: Outcome, xfail_checks: Any) -> Outcome:
    """``outcome`` under the decoder's declared known failures (scikit-learn's ``_xfail_checks``, issue 65 item 4): a
    failure or error it declares becomes ``xfail`` with the reason; a pass becomes ``xpass``, a failure (strict: the
    declaration is stale). Not applicable and skipped stay as they are."""
    known = known_failure(xfail_checks, outcome.check, outcome.precision)
    if known is None:
        return outcome
    key, reason = known
    if outcome.status in ("failed", "error"):
        outcome.status, outcome.detail = "xfail", f"known failure ({reason}): {outcome.detail}"
    elif outcome.status in ("passed", "reported"):
        outcome.status = "xpass"
        outcome.detail = f"declared a known failure ({reason}) and passed: remove {key!r} from xfail_checks"
    return outcome
