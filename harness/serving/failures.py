"""Per-request failures as data (issue 59 item 7), as vLLM's benchmark client keeps them
(``benchmarks/lib/endpoint_request_func.py``: each request's ``RequestFuncOutput`` holds ``success`` and ``error``;
failed requests are counted, the failure rate is reported, they miss every goodput SLO, and the run goes on).

A request of a served unit that fails on its own (an HTTP error status, an error event, an event that is not JSON, a
timeout, a connection dropped mid-answer or closed before any answer to each send) is recorded on its
:class:`~dtbench.harness.serving.record.RequestRecord` (``error``: one line) and the unit goes on: its other requests
keep their rows and numbers. No new column holds it (the ``samples`` row of a request that failed would have no
times, tokens or output to store, and every report reads those columns); ``samples.step_stats.server`` does:

- ``cell_load.requests`` and ``cell_load.failed``: the unit's requests sent and failed, on every row of the unit as
  the rest of its load profile (a report counts each unit once: :func:`dtbench.reports.views.engine.unit_loads`);
- ``failed_requests``: on the unit's first stored row only (once per unit, not once per row), per failed request its
  ``prompt_index``, ``sent_s`` and ``failed_s`` (seconds from the unit's start) and its ``error``.

A failed request still held its slot of the concurrency: its span (send to failure) is in the unit's load profile. A
block of C prompts that lost a request keeps its other rows, marked with the rows it kept (``batch_rows`` < C), so a
speedup never pairs it with a full block of the reference (the rule of every partial group:
:func:`dtbench.reports.stats.is_remainder`).

The cell still fails, with one line, when the server is unreachable (nothing listens at its address:
``httpx.ConnectError``, the unit ends at once), when a launched server exited, or when every request of the unit
failed (its first error, and how many requests failed).
"""

from __future__ import annotations

import time
from typing import Any

from dtbench.harness.errors import error_line
from dtbench.harness.serving.process import ServerError
from dtbench.harness.serving.record import RequestRecord

ERROR_CHARS = 300  # a request's error line is clipped to this many characters


def record_failure(record: RequestRecord, exc: Exception, t0: float, timeout_s: float | None = None) -> bool:
    """Record ``exc`` as ``record``'s failure (``error``, and ``done_s``: its failure in seconds from the unit's
    start ``t0``, ``time.perf_counter``; a timeout names the path and ``timeout_s``). Returns False, recording nothing, when the failure is the server's rather
    than the request's: nothing listens at its address (``httpx.ConnectError``: the server is unreachable); the caller
    raises it again and the unit ends (issue 59 item 7)."""
    import httpx

    if isinstance(exc, httpx.ConnectError):
        return False
    record.error = error_line(exc, ERROR_CHARS) or type(exc).__name__
    if isinstance(exc, httpx.TimeoutException) and not str(exc).strip():  # httpx's timeouts say nothing
        request = getattr(exc, "_request", None)
        path = request.url.path if request is not None else "the request"
        record.error = (
            f"{type(exc).__name__}: no answer from {path} within {timeout_s:g} s"
            if timeout_s
            else (f"{type(exc).__name__}: no answer from {path} in time")
        )
    record.done_s = time.perf_counter() - t0
    return True


def incomplete(record: RequestRecord, gen_length: int, stop_at_eos: bool) -> str | None:
    """Why an answered request is no complete answer, or None: it brought no token (a 200 whose events hold none), or
    fewer than T (``gen_length``) without stopping at EOS as asked (a stream that ended early: ``finish_reason``
    missing or ``length``). Such a request is one failed request of its unit (issue 67 item 3); T = 0 judges
    nothing."""
    if gen_length <= 0:
        return None
    if not record.reads or not record.tokens:
        return "HTTP 200 but no token in the answer"
    if len(record.tokens) < gen_length and not (stop_at_eos and record.finish == "stop"):
        how = "the stream ended with no final event" if record.finish is None else f"finish_reason {record.finish!r}"
        return f"HTTP 200 but {len(record.tokens)} of {gen_length} tokens ({how})"
    return None


def check_unit(label: str, where: str, records: list[RequestRecord], server: Any) -> None:
    """Whether a unit whose requests may have failed keeps its other requests (issue 59 item 7).

    Args:
        label: the cell's label; where: how errors name the server (its log, or its URL masked); records: the unit's
            requests; server: the launched server (:class:`~dtbench.harness.serving.process.Launched`), None for a
            ``base_url`` server.

    Raises:
        ServerError: a launched server that exited (a failed request's connection can close before the dying process
            is reaped: waited for up to 2 s when every request failed), or every request failed: the first to fail
            (its error as it was worded before issue 59 for a unit of one request; for more, with their count).
    """
    import subprocess

    failed = [r for r in records if r.error is not None]
    if not failed:
        return
    if server is not None:
        code = server.exited()
        if code is None and len(failed) == len(records):
            try:
                code = server.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                code = None
        if code is not None:
            raise ServerError(
                f"server '{label}' exited with code {code} during the cell; see its log {server.log_path}"
            )
    if len(failed) == len(records):
        first = min(failed, key=lambda r: r.done_s)
        what = first.error if len(records) == 1 else f"all {len(records)} requests failed, the first: {first.error}"
        raise ServerError(f"server '{label}': {what}; {where}")


def load_spans(
    records: list[RequestRecord], gen_length: int
) -> list[tuple[float, float, list[tuple[float, int]], int]]:
    """Per request (send, end: seconds from the unit's start; its reads; its tokens, T at most) for the unit's load
    profile (:func:`~dtbench.harness.serving.traffic.unit_load`): a failed request held its slot of the concurrency
    from its send to its failure, and brought no tokens (what it streamed before failing is not counted)."""
    return [
        (r.sent_s, r.done_s, [] if r.error else r.reads, 0 if r.error else min(len(r.tokens), gen_length))
        for r in records
    ]


def unit_requests(records: list[RequestRecord]) -> dict[str, int]:
    """The unit's ``requests`` sent and ``failed`` (stored in its ``cell_load``)."""
    return {"requests": len(records), "failed": sum(r.error is not None for r in records)}


def failed_requests(records: list[RequestRecord], prompts: list[Any]) -> list[dict[str, Any]]:
    """Per failed request of a unit (row order): ``prompt_index``, ``sent_s``, ``failed_s`` (seconds from the unit's
    start) and ``error`` (one line)."""
    return [
        {"prompt_index": p.index, "sent_s": r.sent_s, "failed_s": r.done_s, "error": r.error}
        for p, r in zip(prompts, records)
        if r.error is not None
    ]


def kept_rows(records: list[RequestRecord], block: tuple[int, ...]) -> int:
    """The rows of a block of C prompts that did not fail (its ``batch_rows``)."""
    return sum(records[i].error is None for i in block)
