"""The output check of a server cell (T = 0): each request's tokens against the reference server's on the same prompt.

*Tie-aware* (the suite's ``lossless_check: tie_aware`` and ``top_logprobs`` >= 2): the first divergence is a tie when
the reference server's top-2 log-probability margin there, asked in check requests after the timed ones, is within
the engine's measured noise or ``tie_margin`` (the one tie rule, :func:`dtbench.harness.measurement.lossless.tie_or_error`); the
tokens after it follow another prefix and are not compared. Otherwise *exact*. The rule that applied is stored with
every sample (``step_stats.server.lossless_rule``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dtbench.core import redact_credentials
from dtbench.decoders.engines import engine_for
from dtbench.harness.errors import clip
from dtbench.harness.serving.params import ServerParams, auth_headers, tls_context
from dtbench.harness.serving.process import ServerError, ServerPool
from dtbench.harness.suites.grouping import CellKey
from dtbench.harness.values import first_divergence

Shapes = tuple[list[tuple[Any, float]] | None, list[tuple[Any, float]] | None]  # (decode, prefill) candidates


def check_request(
    tokens: list[int],
    reference: list[int] | None,
    top_at: Callable[[int], Shapes] | None,
    params: ServerParams,
    rule: str,
) -> dict[str, Any]:
    """The lossless columns of one request against the reference server's output on the same prompt.

    Tie-aware (``rule`` tie_aware and ``top_logprobs`` >= 2): at the first divergence i, the reference emitted ``a``
    and this server ``b``. ``top_at(i)`` asks the reference server, in check requests outside the timed region, for
    its top candidates at i computed in two shapes (:func:`candidate_shapes`): as one token decoded on the cache (the
    shape of the timed run) and inside a prefill over the whole prefix. Their largest disagreement on a candidate both list
    is the engine's measured *noise* there (batch shapes and quantized kernels round differently: on CPU llama.cpp
    switches matrix kernels with the batch size). The divergence is a *tie* when both tokens are among the decode
    shape's candidates and ``lp[a] - lp[b] <= max(tie_margin, noise)`` (:func:`~dtbench.harness.measurement.lossless.tie_or_error`),
    else an *error*; positions after a tie follow
    another prefix and are not compared. Exact otherwise: the outputs must be equal token for token.

    Args:
        top_at: ``i -> (decode-shape candidates, prefill-shape candidates)``, each ``[(token id, log-probability)]``
            best first or None; None: no check requests (the exact rule).

    Returns:
        ``lossless``, ``first_divergence``, ``lossless_checked``/``_ties``/``_errors``/``_first_error``/
        ``_tie_margin``/``_error_margin``/``_noise``, ``lossless_diagnoses`` and the rule that applied
        (``lossless_rule``).
    """
    out: dict[str, Any] = {"lossless": None, "first_divergence": None, "lossless_rule": None}
    if reference is None:
        return out
    from dtbench.harness.measurement.lossless import (
        tie_or_error,  # the one tie rule (imports torch: after the timed requests)
    )

    div = first_divergence(tokens, reference)
    tie_rule = (
        f"tie_aware (the reference server's top-2 log-probability margin at the divergence <= max({params.tie_margin:g}, "
        f"the noise between its decode and prefill shapes there))"
    )
    tie_aware = rule == "tie_aware" and params.top_logprobs >= 2 and top_at is not None
    out["lossless_rule"] = tie_rule if tie_aware else "exact"
    out["first_divergence"] = div
    if div is None:
        out.update(lossless=True, lossless_checked=len(tokens), lossless_ties=0, lossless_errors=0)
        return out
    checked = div + 1
    shapes = top_at(div) if top_at is not None and tie_aware and div < min(len(tokens), len(reference)) else None
    decode, prefill = shapes if shapes else (None, None)
    top = decode or prefill
    if top is None or not all(isinstance(c[0], int) for c in top):
        if tie_aware:
            out["lossless_rule"] = "exact (the reference server returned no top candidates with token ids)"
        out.update(
            lossless=False, lossless_checked=checked, lossless_ties=0, lossless_errors=1, lossless_first_error=div
        )
        return out
    a, b = reference[div], tokens[div]
    lp = {c[0]: c[1] for c in top}
    other = {c[0]: c[1] for c in (prefill or [])} if decode else {}
    common = set(lp) & set(other)
    noise = max((abs(lp[t] - other[t]) for t in common), default=0.0)
    margin = lp[a] - lp[b] if a in lp and b in lp else None
    diagnosis: dict[str, Any] = {
        "position": div,
        "reference_token": a,
        "emitted_token": b,
        "margin": margin,
        "noise": noise,
        "decode_top": [list(c) for c in decode] if decode else None,
        "prefill_top": [list(c) for c in prefill] if prefill else None,
    }
    if tie_or_error(margin, noise, tolerance=params.tie_margin) == "tie":
        diagnosis["verdict"] = "tie"
        out.update(
            lossless=True,
            lossless_checked=checked,
            lossless_ties=1,
            lossless_errors=0,
            lossless_tie_margin=margin,
            lossless_noise=noise,
            lossless_diagnoses=[diagnosis],
        )
    else:
        diagnosis["verdict"] = "error"
        out.update(
            lossless=False,
            lossless_checked=checked,
            lossless_ties=0,
            lossless_errors=1,
            lossless_first_error=div,
            lossless_error_margin=margin,
            lossless_noise=noise,
            lossless_diagnoses=[diagnosis],
        )
    return out


def candidate_shapes(
    base_url: str, params: ServerParams, prompt: list[int], reference: list[int], i: int, n: int
) -> Shapes:
    """The server's top ``n`` candidates at output position i in two shapes (check requests, not timed): *decode*,
    the prefix up to i - 1 as the prompt and two tokens generated (the second is decoded alone on the cache, as in
    the timed run; used only when the first is ``reference[i - 1]``), and *prefill*, the prefix up to i as the prompt
    and one token generated. Returns (decode or None, prefill or None).

    Raises:
        ServerError: as :func:`top_candidates`.
    """
    prefill = top_candidates(base_url, params, prompt + list(reference[:i]), n)
    decode = None
    if i >= 1:
        both = top_candidates(base_url, params, prompt + list(reference[: i - 1]), n, tokens=2)
        if both and len(both) == 2 and both[0] and both[0][0][0] == reference[i - 1]:
            decode = both[1]
    return decode, prefill


def top_candidates(
    base_url: str, params: ServerParams, prompt: list[int], n: int, tokens: int = 1, timeout: float = 120.0
) -> Any:
    """The server's top ``n`` candidates of the next token after ``prompt`` (one greedy check request, not timed),
    best first (``[(token id, log-probability)]``); with ``tokens`` > 1, the list of each generated position's
    candidates (:data:`~dtbench.decoders.engines.Candidates`). None when none came back. ``timeout`` in seconds.

    Raises:
        ServerError: an HTTP error status, or an answer that is not a JSON object (the caller names the server and
            its log).
    """
    import httpx

    engine = engine_for(params.engine)
    response = httpx.post(
        base_url + "/v1/completions",
        json=engine.top_body(params, prompt, n, tokens),
        timeout=timeout,
        headers=auth_headers(params),
        verify=tls_context(),
    )
    if response.status_code != 200:
        raise ServerError(f"answered the check request with HTTP {response.status_code}: {clip(response.text, 200)}")
    try:
        answer = response.json()
    except ValueError:  # e.g. a server that does not do non-streamed requests or top log-probabilities
        raise ServerError(
            f"answered the check request (top log-probabilities, not streamed) with a body that is not JSON: "
            f"{clip(response.text, 120) or '(empty)'}"
        ) from None
    if not isinstance(answer, dict):
        raise ServerError(f"answered the check request with JSON that is not an object: {clip(answer, 120)}")
    chunk = engine.parse_event(answer)
    if tokens > 1:
        return chunk.top or None
    return chunk.top[0] if chunk.top else None


def check_row(
    tokens: list[int],
    ref: list[int] | None,
    prompt: Any,
    params: ServerParams,
    reference: tuple[str, ServerParams] | None,
    pool: ServerPool,
    cell: CellKey,
    concurrency: int,
    rule: str,
) -> dict[str, Any]:
    """The output check of one request (:func:`~dtbench.harness.serving.check.check_request`), asking the reference
    server of this load level for its candidates at a divergence.

    Raises:
        ServerError: the reference server failed a check request (one line naming it and its log).
    """
    top_at: Callable[[int], Shapes] | None = None
    ref_label = reference[0] if reference is not None else ""
    ref_where = ""
    if reference is not None and ref is not None:
        ref_url, ref_server = pool.endpoint(reference[0], reference[1], cell, concurrency)
        ref_where = f"see its log {ref_server.log_path}" if ref_server else f"at {redact_credentials(ref_url)}"
        ids, ref_params, ref_tokens, n = list(prompt.token_ids), reference[1], ref, max(params.top_logprobs, 5)

        def shapes_at(i: int) -> Shapes:
            return candidate_shapes(ref_url, ref_params, ids, ref_tokens, i, n)

        top_at = shapes_at
    try:
        return check_request(tokens, ref, top_at, params, rule)
    except ServerError as exc:
        raise ServerError(f"reference server '{ref_label}' {exc}; {ref_where}") from None
