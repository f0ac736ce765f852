"""The conformance kit for a served engine (issue 66): ``dtbench check --server URL --reference URL``.

People who deploy speculative decoding find its correctness bugs by hand (vLLM issue #41758: n-gram speculation
changed greedy output on the prompt ``"serving" * 48``; #11466 asks whether speculation preserves the target's output
at all; PR #7962: log-probabilities are not stable across batch sizes, so a divergence can be a numeric tie or a bug).
This module runs the kit's idea against an engine over HTTP: named checks, a hypothesis search over prompts
(:func:`dtbench.testing.common.search`, the same search as the decoder kit's, here with shrinking inside a time
budget), and a counterexample ready to file: both requests as ``curl`` commands (the key masked), the prompt's
SHA-256, the first differing position, both tokens and their text, the reference's margin and the measured noise,
and the engine's version and model as the server reports them.

The checks (:data:`SERVER_CHECKS`, in the order they run), each over prompts drawn from :class:`PromptSpace` (the
dataset's text, random token sequences, an n-gram or a word repeated: the shape n-gram and suffix drafting feed on,
and prompts near the context length):

- ``deterministic``: the same request twice gives the same tokens (exact).
- ``greedy_equals_reference`` (needs ``--reference``): T = 0 output equal to the reference engine's (the same engine
  without speculation), with and without stopping at EOS; tie-aware by the run's one rule
  (:func:`dtbench.harness.serving.check.check_request`: the reference's top-2 margin at the divergence against
  ``tie_margin`` and the noise between its decode and prefill shapes).
- ``concurrency``: each of C prompts sent together equals the same prompt sent alone, tie-aware by the same rule
  with the engine's own candidates (batch variance is a tie, reported with its margin, not a failure).
- ``length``: exactly ``max_tokens`` tokens unless it stopped at EOS as asked (then ``finish_reason`` ``stop``), and
  no token after the first EOS.
- ``stop``: with a stop string (a piece of the output's own text), the text ends before its first occurrence and is
  the unstopped text up to there: nothing after a stop.
- ``streaming``: a streamed and a non-streamed request give the same tokens.
- ``accounting``: where the engine reports speculation counters (per response, or its metrics endpoint), accepted <=
  drafted, steps >= 1 and the acceptance length equal to tokens / steps (n/a where it reports none).

A check's verdict is one of the decoder kit's (:class:`~dtbench.testing.checks.Outcome`): passed (its
ties listed), failed (the counterexample), n/a (why). Every chosen check runs at least one example, so each gets a
verdict however little of ``--budget`` is left to it (past the budget it runs that one example, unshrunk).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dtbench.core import DtbenchError
from dtbench.harness.serving.check import check_request
from dtbench.harness.serving.endpoint import Answer, Endpoint, ServerDown
from dtbench.harness.serving.params import auth_headers, tls_context
from dtbench.harness.serving.prompt_space import PromptSpace, prompt_sha256
from dtbench.testing.checks import Outcome
from dtbench.testing.common import CheckFailed, NotApplicable, search

SERVER_CHECKS = (
    "deterministic",
    "greedy_equals_reference",
    "concurrency",
    "length",
    "stop",
    "streaming",
    "accounting",
)
EXAMPLES = {  # hypothesis examples per check by default (each example is one to C + 1 requests)
    "deterministic": 8,
    "greedy_equals_reference": 100,
    "concurrency": 8,
    "length": 10,
    "stop": 8,
    "streaming": 8,
    "accounting": 10,
}
ACCOUNTING_MIN_T = 16  # the accounting check's smallest max_tokens: long enough for an engine to draft
PRECISION = "served"  # the table's column suffix: the engine's own precision, whatever it is


@dataclass
class Session:
    """What every check of one engine shares: the engine, the reference (None: the greedy check is n/a), the prompt
    space, the budget's deadline (``time.monotonic``), max T, the concurrency C, the EOS ids, examples per check
    (``examples``: None, each check's own) and the ties each check saw."""

    engine: Endpoint
    reference: Endpoint | None
    space: PromptSpace
    deadline: float
    max_T: int = 32
    concurrency: int = 4
    eos: frozenset[int] = frozenset()
    examples: int | None = None
    shrink: bool = True
    ties: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def n(self, check: str) -> int:
        return self.examples if self.examples is not None else EXAMPLES[check]

    def token(self, t: int | None) -> dict[str, Any] | None:
        return None if t is None else {"id": t, "text": self.space.text_of([t])}


def _prompt_fields(s: Session, prompt: list[int]) -> dict[str, Any]:
    return {
        "prompt_sha256": prompt_sha256(prompt),
        "prompt_tokens": len(prompt),
        "prompt": list(prompt),
        "prompt_text": s.space.text_of(prompt),
    }


def _divergence(s: Session, check: str, prompt: list[int], got: Answer, want: Answer, result: dict[str, Any],
                bodies: tuple[dict[str, Any], dict[str, Any]], against: Endpoint, extra: dict[str, Any]) -> dict:  # fmt: skip
    """The counterexample of a divergence ``result`` (:func:`check_request`'s columns) between the engine's answer
    ``got`` and ``want`` (the reference's, or the engine's own in another shape), ready to file."""
    diag = (result.get("lossless_diagnoses") or [{}])[0]
    pos = result.get("first_divergence")
    a = want.tokens[pos] if pos is not None and pos < len(want.tokens) else None
    b = got.tokens[pos] if pos is not None and pos < len(got.tokens) else None
    return {
        "check": check,
        **_prompt_fields(s, prompt),
        **extra,
        "position": pos,
        "engine_token": s.token(b),
        "reference_token": s.token(a),
        "margin": diag.get("margin"),
        "noise": diag.get("noise"),
        "tie_margin": s.engine.params.tie_margin,
        "rule": result.get("lossless_rule"),
        "curl": {"engine": s.engine.curl(bodies[0]), "reference": against.curl(bodies[1])},
    }


def _judge(s: Session, check: str, prompt: list[int], got: Answer, want: Answer, against: Endpoint,
           bodies: tuple[dict[str, Any], dict[str, Any]], extra: dict[str, Any], what: str) -> None:  # fmt: skip
    """Compare ``got`` with ``want`` by the run's tie rule (candidates asked of ``against`` at a divergence): a tie is
    recorded in ``s.ties``; an error raises :class:`CheckFailed` with the counterexample."""
    if got.error or want.error:
        failed = got.error or want.error
        raise CheckFailed(f"a request failed: {failed}", {"check": check, **_prompt_fields(s, prompt), **extra})
    if got.tokens == want.tokens:
        return
    ids = list(prompt)
    result = check_request(
        got.tokens, want.tokens, lambda i: against.candidates(ids, want.tokens, i), s.engine.params, "tie_aware"
    )
    example = _divergence(s, check, prompt, got, want, result, bodies, against, extra)
    if result["lossless"]:
        seen = s.ties.setdefault(check, [])
        key = (example["prompt_sha256"], extra.get("T"), example["position"])
        if all((t["prompt_sha256"], t.get("T"), t["position"]) != key for t in seen):
            seen.append(example)
        return
    pos, a, b = example["position"], example["reference_token"], example["engine_token"]
    margin = example["margin"]
    shown = f"margin {margin:.3g} nats" if isinstance(margin, float) else "no margin (a token not among the top)"
    raise CheckFailed(
        f"{what} at output position {pos}: {b and b['id']} instead of {a and a['id']} ({shown}, noise "
        f"{example['noise'] or 0:.3g}; {len(prompt)}-token prompt)",
        example,
    )


def _greedy(s: Session) -> dict[str, Any]:
    from hypothesis import strategies as st

    if s.reference is None:
        raise NotApplicable("no reference engine (--reference URL, or a suite entry's reference:)")
    ref = s.reference

    def body(prompt: list[int], T: int, stop_at_eos: bool) -> None:
        mine, theirs = s.engine.body(prompt, T, stop_at_eos), ref.body(prompt, T, stop_at_eos)
        got, want = s.engine.once(mine), ref.once(theirs)
        extra = {"T": T, "stop_at_eos": stop_at_eos}
        _judge(
            s, "greedy_equals_reference", prompt, got, want, ref, (mine, theirs), extra, "differs from the reference"
        )

    space = {"prompt": s.space.prompts(near_context=True), "T": st.integers(1, s.max_T), "stop_at_eos": st.booleans()}
    return _search(s, "greedy_equals_reference", space, body)


def _deterministic(s: Session) -> dict[str, Any]:
    from hypothesis import strategies as st

    def body(prompt: list[int], T: int) -> None:
        request = s.engine.body(prompt, T, False)
        first, second = s.engine.send([request])[0], s.engine.send([request])[0]
        if first.error or second.error or first.tokens != second.tokens:
            example = {"check": "deterministic", **_prompt_fields(s, prompt), "T": T, "curl": s.engine.curl(request)}
            if first.error or second.error:
                raise CheckFailed(f"a request failed: {first.error or second.error}", example)
            i = next(i for i in range(max(len(first.tokens), len(second.tokens))) if first.tokens[i:i + 1] != second.tokens[i:i + 1])  # fmt: skip
            example.update(position=i, first=first.tokens[i : i + 1], second=second.tokens[i : i + 1])
            raise CheckFailed(f"the same request twice differs at output position {i}", example)

    return _search(s, "deterministic", {"prompt": s.space.prompts(), "T": st.integers(1, s.max_T)}, body)


def _concurrency(s: Session) -> dict[str, Any]:
    from hypothesis import strategies as st

    C = s.concurrency
    if C < 2:
        raise NotApplicable("concurrency 1 (--concurrency C >= 2 sends C requests together)")

    def body(prompts: list[list[int]], T: int) -> None:
        bodies = [s.engine.body(p, T, False) for p in prompts]
        together = s.engine.send(bodies, concurrency=C)
        for r, (p, b, got) in enumerate(zip(prompts, bodies, together)):
            alone = s.engine.once(b)
            extra = {"T": T, "row": r, "concurrency": C, "others": [prompt_sha256(q) for q in prompts if q is not p]}
            _judge(s, "concurrency", p, got, alone, s.engine, (b, b), extra, f"sent among {C} differs from sent alone")

    space = {
        "prompts": st.lists(s.space.prompts(), min_size=C, max_size=C, unique_by=tuple),
        "T": st.integers(max(1, s.max_T // 2), s.max_T),
    }
    return _search(s, "concurrency", space, body, size=lambda kw: sum(len(p) for p in kw["prompts"]))


def _length(s: Session) -> dict[str, Any]:
    from hypothesis import strategies as st

    def body(prompt: list[int], T: int, stop_at_eos: bool) -> None:
        request = s.engine.body(prompt, T, stop_at_eos)
        got = s.engine.once(request)
        example = {"check": "length", **_prompt_fields(s, prompt), "T": T, "stop_at_eos": stop_at_eos,
                   "tokens": len(got.tokens), "finish_reason": got.finish, "curl": s.engine.curl(request)}  # fmt: skip
        if got.error:
            raise CheckFailed(f"the request failed: {got.error}", example)
        eos_at = next((i for i, t in enumerate(got.tokens) if t in s.eos), None)
        if len(got.tokens) > T:
            raise CheckFailed(f"sent {len(got.tokens)} tokens for max_tokens {T}", example)
        if stop_at_eos and eos_at is not None and eos_at < len(got.tokens) - 1:
            raise CheckFailed(f"sent {len(got.tokens) - eos_at - 1} token(s) after EOS at position {eos_at}", example)
        if len(got.tokens) < T and not (stop_at_eos and got.finish == "stop"):
            raise CheckFailed(
                f"sent {len(got.tokens)} of {T} tokens (finish_reason {got.finish!r}"
                + (", EOS ignored as asked" if not stop_at_eos else "")
                + ")",
                example,
            )

    space = {"prompt": s.space.prompts(), "T": st.integers(1, s.max_T), "stop_at_eos": st.booleans()}
    return _search(s, "length", space, body)


def _stop(s: Session) -> dict[str, Any]:
    from hypothesis import strategies as st

    def body(prompt: list[int], T: int, at: int) -> None:
        full = s.engine.once(s.engine.body(prompt, T, False))
        if full.error:
            raise CheckFailed(f"the request failed: {full.error}", {"check": "stop", **_prompt_fields(s, prompt)})
        pieces = [s.space.text_of([t]) for t in full.tokens]
        stop = pieces[at % len(pieces)].strip() if pieces else ""
        if len(stop) < 2 or stop not in full.text:
            return  # a token without text of its own (whitespace, a byte of a character): nothing to stop on
        request = s.engine.body(prompt, T, False, stop=[stop])
        got = s.engine.once(request)
        want = full.text[: full.text.index(stop)]
        if got.error or got.text != want:
            example = {"check": "stop", **_prompt_fields(s, prompt), "T": T, "stop": stop, "text": got.text,
                       "expected_text": want, "curl": s.engine.curl(request)}  # fmt: skip
            if got.error:
                raise CheckFailed(f"the request failed: {got.error}", example)
            what = "text after the stop string" if len(got.text) > len(want) else "text that is not the unstopped text"
            raise CheckFailed(f"with stop {stop!r}: {what} ({len(got.text)} characters, {len(want)} expected)", example)

    space = {"prompt": s.space.prompts(), "T": st.integers(4, s.max_T), "at": st.integers(1, 64)}
    return _search(s, "stop", space, body)


def _streaming(s: Session) -> dict[str, Any]:
    from hypothesis import strategies as st

    def body(prompt: list[int], T: int) -> None:
        request = s.engine.body(prompt, T, False)
        streamed, plain = s.engine.once(request), s.engine.unstreamed(request)
        if streamed.error or plain.error or streamed.tokens != plain.tokens:
            example = {"check": "streaming", **_prompt_fields(s, prompt), "T": T, "streamed": streamed.tokens,
                       "not_streamed": plain.tokens, "curl": s.engine.curl(request)}  # fmt: skip
            if streamed.error or plain.error:
                raise CheckFailed(f"a request failed: {streamed.error or plain.error}", example)
            n = min(len(streamed.tokens), len(plain.tokens))
            i = next((i for i in range(n) if streamed.tokens[i] != plain.tokens[i]), n)
            raise CheckFailed(f"streamed and non-streamed output differ at output position {i}", example)

    return _search(s, "streaming", {"prompt": s.space.prompts(), "T": st.integers(1, s.max_T)}, body)


def _accounting(s: Session) -> dict[str, Any]:
    from hypothesis import strategies as st

    engine = s.engine.engine
    seen = {"counted": 0}

    def body(prompt: list[int], T: int) -> None:
        request = s.engine.body(prompt, T, False)
        got = s.engine.once(request)
        if got.error:
            return
        example = {"check": "accounting", **_prompt_fields(s, prompt), "T": T, "tokens": len(got.tokens),
                   "counters": got.counters, "curl": s.engine.curl(request)}  # fmt: skip
        try:
            spec = engine.acceptance(got.counters, len(got.tokens))
        except DtbenchError as exc:
            raise CheckFailed(str(exc), example) from None
        if not spec:
            return
        seen["counted"] += 1
        drafted, accepted, steps = spec.get("drafted"), spec.get("accepted"), spec.get("steps")
        example["acceptance"] = spec
        if drafted is not None and accepted is not None and accepted > drafted:
            raise CheckFailed(f"accepted {accepted} > drafted {drafted}", example)
        if steps is not None and not 1 <= steps <= max(len(got.tokens), 1):
            raise CheckFailed(f"{steps} verification steps for {len(got.tokens)} tokens", example)
        length = spec.get("acceptance_length")
        if steps and length is not None and abs(length - len(got.tokens) / steps) > 1e-6 * max(1.0, length):
            raise CheckFailed(
                f"acceptance length {length:g} is not tokens / steps = {len(got.tokens)} / {steps}", example
            )

    before = _metrics(s.engine)
    # T from ACCOUNTING_MIN_T: hypothesis tries the smallest T first, and an engine may draft nothing for 2 tokens
    # (from T = 2, llama.cpp's draft model reported counters in 1 answer of the first 3; from 16, in the first), so a
    # search the budget cuts short would wrongly say n/a
    T = st.integers(min(ACCOUNTING_MIN_T, s.max_T), s.max_T)
    out = _search(s, "accounting", {"prompt": s.space.prompts(), "T": T}, body)
    after = _metrics(s.engine)
    if before is not None and after is not None:
        try:
            delta = engine.metrics_delta(before, after)
        except DtbenchError as exc:
            raise CheckFailed(f"its metrics endpoint: {exc}") from None
        drafted, accepted = delta.get("drafted"), delta.get("accepted")
        if isinstance(drafted, int | float) and isinstance(accepted, int | float) and accepted > drafted:
            raise CheckFailed(f"its metrics count accepted {accepted:g} > drafted {drafted:g}", {"metrics": delta})
        seen["counted"] += bool(delta)
    if not seen["counted"]:
        raise NotApplicable("the engine reported no speculation counters (none in its responses or metrics)")
    out["counted"] = seen["counted"]
    return out


def _metrics(ep: Endpoint) -> dict[str, Any] | None:
    import httpx

    path = ep.engine.metrics_path
    if path is None or ep.down:
        return None
    try:
        answer = httpx.get(ep.base_url + path, timeout=10.0, headers=auth_headers(ep.params), verify=tls_context())
    except httpx.HTTPError:
        return None
    return ep.engine.parse_metrics(answer.text) if answer.status_code == 200 else None


CHECKS: dict[str, Callable[[Session], dict[str, Any]]] = {
    "deterministic": _deterministic,
    "greedy_equals_reference": _greedy,
    "concurrency": _concurrency,
    "length": _length,
    "stop": _stop,
    "streaming": _streaming,
    "accounting": _accounting,
}


def _size(kw: dict[str, Any]) -> int:
    return len(kw.get("prompt") or [])


def _search(s: Session, check: str, space: dict[str, Any], body: Callable[..., None], size=_size) -> dict[str, Any]:
    """:func:`~dtbench.testing.common.search` with shrinking until the check's deadline; the ``ServerDown``
    a request raises ends the search at once."""
    down: list[ServerDown] = []

    def guarded(**kw: Any) -> None:
        if down:
            return
        try:
            body(**kw)
        except ServerDown as exc:
            down.append(exc)

    stats = search(s.n(check), space, guarded, shrink=s.shrink, deadline=s.deadline, size=size, at_least=1)
    if down:
        raise down[0]
    return {"examples": stats.examples, "out_of_time": stats.out_of_time}


def run_checks(s: Session, checks: list[str] | None = None, progress: Callable[[Outcome], None] | None = None) -> list[Outcome]:  # fmt: skip
    """Run the chosen checks (:data:`SERVER_CHECKS` order) on ``s.engine``, the budget shared: each check may use the
    time left divided by the checks left (a check that ends early leaves its time to the others), and each runs at
    least one example, even past the budget (a check the budget never reached would give no verdict; on a slow
    engine the command overruns ``--budget`` by at most one example per check).

    Returns:
        One :class:`~dtbench.testing.checks.Outcome` per check (``precision`` ``served``): its examples
        and ties in ``detail``, the ties in ``counterexample["ties"]`` for a pass, the shrunk counterexample for a
        failure.
    """
    chosen = [c for c in SERVER_CHECKS if checks is None or c in checks]
    end = s.deadline
    outcomes: list[Outcome] = []
    for k, name in enumerate(chosen):
        start = time.monotonic()
        s.deadline = start + max(0.0, end - start) / (len(chosen) - k)
        outcome = Outcome(s.engine.label, name, PRECISION, "passed")
        try:
            if s.engine.down or (s.reference is not None and s.reference.down):
                raise ServerDown(s.engine.down or (s.reference.down if s.reference else ""))
            stats = CHECKS[name](s)
            ties = s.ties.get(name, [])
            outcome.detail = f"{stats['examples']} example(s)" + (
                " (the budget ran out: fewer than asked)" if stats["out_of_time"] else ""
            )
            if "counted" in stats:
                outcome.detail += f"; speculation counters in {stats['counted']} answer(s)"
            if ties:
                margins = ", ".join(f"{t['margin']:.3g}" for t in ties if isinstance(t.get("margin"), float))
                outcome.detail += f"; {len(ties)} tie(s) (margins {margins} nats)"
                outcome.counterexample = {"ties": ties}
        except CheckFailed as exc:
            outcome.status, outcome.detail, outcome.counterexample = "failed", exc.message, exc.counterexample
        except NotApplicable as exc:
            outcome.status, outcome.detail = "n/a", str(exc)
        except ServerDown as exc:
            outcome.status, outcome.detail = "failed", str(exc)
        outcome.seconds = time.monotonic() - start
        if outcome.status == "failed" and outcome.counterexample:
            outcome.counterexample.setdefault("engine", s.engine.identity())
            if s.reference is not None:
                outcome.counterexample.setdefault("reference_engine", s.reference.identity())
        outcomes.append(outcome)
        if progress is not None:
            progress(outcome)
    s.deadline = end
    return outcomes


__all__ = ["CHECKS", "EXAMPLES", "SERVER_CHECKS", "Answer", "Endpoint", "PromptSpace", "ServerDown", "Session",
           "prompt_sha256", "run_checks"]  # fmt: skip
