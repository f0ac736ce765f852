"""One unit of a server cell through the bounded async client (issue 30, issue 39): the requests, the clock, the rows.

:func:`observe_requests` sends a unit (its warmup prompts, or all its measured prompts:
:func:`~dtbench.harness.suites.grouping.cell_units`) as streamed ``/v1/completions`` requests by one ``httpx.AsyncClient``
through a semaphore of C (the load level is the concurrency): C in flight all the time, a new request starting when
one finishes (steady concurrency, issue 39; vLLM ``bench serve --max-concurrency``, GuideLLM's ``concurrent``
profile), every request ready at the start or arriving at seeded gaps (:mod:`~dtbench.harness.serving.traffic`).
Every network read of a response is timestamped (``time.perf_counter``) when it arrives: a request's TTFT is its first
token's arrival minus its send time, its inter-token latencies (ITL) the gaps between reads that brought tokens, its
end-to-end latency (E2E) the last token's arrival minus its send time. The engine adapter of ``params.engine``
(:mod:`dtbench.decoders.engines`) writes each request and reads each event and the server's counters; each request
becomes a :class:`~dtbench.harness.measurement.observation.Served` observation, and its row is
:func:`~dtbench.harness.measurement.observation.sample_row`'s, as every decoder's (TPOT, throughput, the output's identity), with the
server's record (``step_stats.server``), its block of C prompts and the output check
(:mod:`~dtbench.harness.serving.check`).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dtbench.harness.serving.failures as failures
from dtbench.core import redact_credentials
from dtbench.decoders.engines import Engine, engine_for
from dtbench.harness.errors import DtbenchError, clip, error_line
from dtbench.harness.measurement.measurers import Batch, Observed
from dtbench.harness.measurement.observation import Served
from dtbench.harness.serving.check import check_row
from dtbench.harness.serving.params import ServerParams, auth_headers, tls_context
from dtbench.harness.serving.process import ServerError, ServerPool
from dtbench.harness.serving.record import RequestRecord, TokenBytes, recover_ids, token_bytes_of
from dtbench.harness.serving.traffic import Schedule, blocks_of, dispatch, schedule, unit_load
from dtbench.harness.suites.grouping import CellKey


def sse_events(buffer: bytes) -> tuple[list[dict[str, Any]], bytes]:
    """Complete server-sent events of ``buffer`` as JSON objects, and the incomplete rest.

    Raises:
        ServerError: an event whose data is not JSON.
    """
    out = []
    buffer = buffer.replace(b"\r\n", b"\n")
    *complete, rest = buffer.split(b"\n\n")
    for block in complete:
        data = b"\n".join(line[5:].lstrip() for line in block.split(b"\n") if line.startswith(b"data:"))
        if not data or data.strip() == b"[DONE]":
            continue
        try:
            out.append(json.loads(data))
        except json.JSONDecodeError:
            raise ServerError(
                f"the server sent an event that is not JSON: {clip(data.decode(errors='replace'), 200)}"
            ) from None
    return out, rest


async def _request(
    client: Any,
    url: str,
    body: dict,
    params: ServerParams,
    engine: Engine,
    record: RequestRecord,
    t0: float,
    tokenize: Callable[[str], list[int]],
) -> None:
    """One request of a unit into ``record``, its times from the unit's start ``t0`` (``time.perf_counter``); sent
    once more, counted, when the server closed the connection before any response.

    Raises:
        ServerError: as :func:`_read_stream`, or a connection closed without a response to every send.
    """
    while True:
        sent = time.perf_counter()
        record.sent_s = sent - t0
        try:
            await _read_stream(client, url, body, params, engine, record, sent)
            break
        except _ClosedBeforeResponse:
            # The server closed the connection before any response (a request it never started: its log shows no
            # task; seen from llama-server on a loaded machine): sent once more, the clock restarted, counted.
            if record.resent >= RESENDS:
                raise ServerError(
                    f"closed the connection without a response to each of {record.resent + 1} sends"
                ) from None
            record.resent += 1
            await asyncio.sleep(0.2)
    if params.prompt_format == "text" or not record.tokens and record.text:
        record.tokens = tokenize(record.text)
    record.done_s = time.perf_counter() - t0


RESENDS = 1  # how often a request the server closed before any response is sent again


class _ClosedBeforeResponse(Exception):
    """The server closed the connection before sending a status line (``httpx.RemoteProtocolError`` then)."""


async def _read_stream(
    client: Any,
    url: str,
    body: dict,
    params: ServerParams,
    engine: Engine,
    record: RequestRecord,
    sent: float,
) -> None:
    """One send of a streamed request and its events into ``record`` (token ids, gaps, text, counters, reads timed
    from ``sent``).

    Raises:
        _ClosedBeforeResponse: the connection closed before a status line (nothing of the request was read).
        ServerError: an HTTP error status or an event that is not JSON.
    """
    import httpx

    answered = False
    try:
        async with client.stream("POST", url, json=body, timeout=params.request_timeout_s) as response:
            answered = True
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise ServerError(f"answered HTTP {response.status_code}: {clip(text, 300)}")
            buffer = b""
            decoded = 0
            parsed = 0  # events read: none and a body left over is a 200 whose body is no event stream
            async for raw in response.aiter_bytes():
                now = time.perf_counter()
                events, buffer = sse_events(buffer + raw)
                parsed += len(events)
                brought = 0
                for event in events:
                    chunk = engine.parse_event(event)
                    if chunk.decoded is not None:  # llama.cpp holds back a token that ends inside a UTF-8
                        brought += chunk.decoded - decoded  # character and sends the next event with one id only:
                        held = chunk.decoded - decoded - len(chunk.tokens or [])  # its decoded count says how
                        if held > 0:  # many tokens the read brought; the ids it left out come before its own
                            record.gaps.append((decoded, decoded + held))
                            record.gap_events.append((chunk.text, list(chunk.tokens or [])))
                        decoded = chunk.decoded
                        record.tokens.extend(chunk.tokens or [])
                    elif chunk.tokens is not None:
                        record.tokens.extend(chunk.tokens)
                        brought += len(chunk.tokens)
                    elif chunk.text:
                        brought += 1  # a text-only engine: one chunk, token count unknown until re-tokenized
                    final = chunk.counters.get("usage:completion_tokens")
                    if decoded and final is not None and final > decoded:  # the last tokens ended inside a UTF-8
                        brought += int(final) - decoded  # character: they arrive with the final event, no ids
                        record.gaps.append((decoded, int(final)))
                        record.gap_events.append(None)
                        decoded = int(final)
                    record.text += chunk.text
                    record.top.extend(chunk.top)
                    record.counters.update(chunk.counters)
                    record.finish = chunk.finish or record.finish
                if brought:
                    record.reads.append((now - sent, brought))
            if not parsed and buffer.strip():  # one failed request, never the cell's end (issue 67 item 3)
                shown = clip(buffer.decode(errors="replace").strip(), 200)
                raise ServerError(f"HTTP 200 but the body is not a stream of JSON events: {shown}")
            record.decoded = decoded
    except httpx.RemoteProtocolError as exc:
        if not answered and "without sending a response" in str(exc):
            raise _ClosedBeforeResponse() from None
        raise


async def group_requests(
    base_url: str,
    bodies: list[dict[str, Any]],
    params: ServerParams,
    traffic: Schedule,
    tokenize: Callable[[str], list[int]],
    engine: Engine,
) -> tuple[list[RequestRecord], float, dict[str, Any], dict[str, Any]]:
    """A unit's requests by one client, as ``traffic`` dispatches them (:func:`~dtbench.harness.serving.traffic.
    dispatch`): (records, wall seconds, the engine's counters before, after). The server kit sends through it too
    (:mod:`dtbench.harness.serving.endpoint`)."""
    import httpx

    url = base_url + "/v1/completions"
    concurrency = traffic.concurrency
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    kw = {"headers": auth_headers(params), "verify": tls_context()}  # the API key read now (issue 50 item 3)
    async with httpx.AsyncClient(limits=limits, timeout=params.request_timeout_s, **kw) as client:
        before = await _metrics(client, base_url, engine)
        records = [RequestRecord(row=i) for i in range(len(bodies))]
        t0 = time.perf_counter()

        async def send(i: int) -> None:
            try:
                await _request(client, url, bodies[i], params, engine, records[i], t0, tokenize)
            except Exception as exc:  # a request that failed is data, the unit goes on (issue 59 item 7) ...
                if not failures.record_failure(records[i], exc, t0, params.request_timeout_s):  # ... unless unreachable
                    raise

        await dispatch(traffic, send)
        wall = time.perf_counter() - t0
        after = await _metrics(client, base_url, engine)
    return records, wall, before, after


async def _metrics(client: Any, base_url: str, engine: Engine) -> dict[str, Any]:
    """The engine's counters endpoint (:attr:`~dtbench.decoders.engines.Engine.metrics_path`, vLLM's ``/metrics``),
    parsed; {} for an engine that reports per response, or an answer other than 200."""
    if engine.metrics_path is None:
        return {}
    response = await client.get(base_url + engine.metrics_path, timeout=30.0)
    if response.status_code != 200:
        return {}
    return engine.parse_metrics(response.text)


def block_wall(records: list[RequestRecord], block: tuple[int, ...]) -> float:
    """A block's wall time (s): its first send to its last token (its requests ran among others' at steady load)."""
    return max(records[i].done_s for i in block) - min(records[i].sent_s for i in block)


@dataclass(frozen=True)
class _Unit:
    """One unit of a server cell as the client measures it: the cell's label and server params, the engine adapter,
    the server's URL (as given: credentials are sent), how errors name it (``where``: its log or its URL with
    credentials masked), the pool and cell key (the reference server's endpoint) and the unit's load level."""

    label: str
    params: ServerParams
    engine: Engine
    base_url: str
    shown_url: str
    server: Any
    where: str
    pool: ServerPool
    cell: CellKey
    concurrency: int

    def error(self, what: str) -> ServerError:
        """``server '<label>' <what>; <where>`` as the one-line error."""
        return ServerError(f"server '{self.label}' {what}; {self.where}")


def _send(
    unit: _Unit,
    bodies: list[dict[str, Any]],
    traffic: Schedule,
    tokenize: Callable[[str], list[int]],
    detokenize: Callable[[list[int]], str],
    token_bytes: TokenBytes | None = None,
    gen_length: int = 0,
    stop_at_eos: bool = False,
) -> tuple[list[RequestRecord], float, dict[str, Any]]:
    """The unit's requests through the client: (records, wall seconds, the engine's counters over the unit).

    Raises:
        ServerError: every request failed (an HTTP error status, an error event, an event that is not JSON, a
            dropped connection or a timeout: one that failed alone is recorded, issue 59 item 7), the server is
            unreachable or exited; impossible counters.
    """
    label, params, engine, server = unit.label, unit.params, unit.engine, unit.server
    try:
        records, wall, before, after = asyncio.run(
            group_requests(unit.base_url, bodies, params, traffic, tokenize, engine)
        )
    except DtbenchError as exc:  # an HTTP error status, an error event, an event that is not JSON
        raise ServerError(f"server '{label}': {exc}; {unit.where}") from None
    except (OSError, Exception) as exc:  # httpx errors, a dropped connection, a timeout
        code = None
        if server is not None:  # a closed connection can come before the dying process can be reaped
            try:
                code = server.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                code = None
        if server is not None and code is not None:
            raise ServerError(
                f"server '{label}' exited with code {code} during the cell; see its log {server.log_path}"
            ) from None
        raise ServerError(f"server '{label}': {error_line(exc, 300)}; {unit.where}") from None
    failures.check_unit(label, unit.where, records, server)  # all requests failed, or the server exited: cell fails
    for rec, body in zip(records, bodies):
        if rec.error is None and rec.decoded and len(rec.tokens) < rec.decoded:
            recover_ids(
                unit.base_url, body, rec, engine, label, unit.where, detokenize, token_bytes, auth_headers(params)
            )
    for rec in records:  # an answer short of its tokens is one failed request, not the cell's end (issue 67 item 3)
        if rec.error is None and (problem := failures.incomplete(rec, gen_length, stop_at_eos)) is not None:
            rec.error = problem
    failures.check_unit(label, unit.where, records, server)
    try:
        group_metrics = engine.metrics_delta(before, after) if after else {}
    except DtbenchError as exc:
        raise ServerError(f"server '{label}': {exc}; {unit.where}") from None
    return records, wall, group_metrics


def observe_requests(
    label: str,
    params: ServerParams,
    prompts: list[Any],
    gen_length: int,
    concurrency: int,
    cell: CellKey,
    pool: ServerPool,
    *,
    seed: int,
    stop_at_eos: bool,
    references: list[list[int] | None] | None,
    reference: tuple[str, ServerParams] | None,
    rule: str,
    tokenizer: Any,
    batch_group: int | None,
) -> list[Observed]:
    """Observe one unit of a server cell: one streamed request per prompt, as its traffic dispatches them
    (:func:`~dtbench.harness.serving.traffic.schedule`: ``concurrency`` kept in flight, a new request starting when
    one finishes, or at its arrival time when later), and the unit's load profile
    (:func:`~dtbench.harness.serving.traffic.load_profile`, stored with every row as ``step_stats.server.cell_load``).

    Args:
        label: the cell's label (errors and logs name it); params: the server's params.
        prompts: the unit's :class:`~dtbench.harness.data.prompt.Prompt` objects, in row order.
        gen_length: T (max_tokens); cell: the cell's point (:class:`~dtbench.harness.suites.grouping.CellKey`: the dataset
            entry's key, L_max, T, B), which the pool keys its servers by.
        pool: the worker's :class:`~dtbench.harness.serving.process.ServerPool`; seed: the arrivals' seed (with the
            unit's first prompt index).
        references: per row the reference server's output tokens (None: this cell is a reference itself; a row's
            None: the reference's request for that prompt failed, not compared).
        reference: (label, params) of the reference server, asked for its top candidates at a divergence (its
            server of this cell's load level is running: the pool stops servers only when the load level moves on).
        rule: the suite's ``lossless_check``; tokenizer: the target's (text prompts and text-only engines).
        batch_group: not None when C > 1: every row's :class:`~dtbench.harness.measurement.measurers.Batch` is its block of C
            prompts (:func:`~dtbench.harness.serving.traffic.blocks_of`: the pairing key ``batch_group``,
            ``batch_rows``, ``batch_total_s``); None: rows unpaired by block (C = 1).

    Returns:
        one :class:`~dtbench.harness.measurement.measurers.Observed` per prompt: its :class:`~dtbench.harness.measurement.observation.Served`
        request, its block and its output check's columns.

    Raises:
        ServerError: the server did not start, is unreachable or exited, every request failed (a request that
            failed alone has no row: :mod:`~dtbench.harness.serving.failures`), or one sent fewer than T tokens.
        DtbenchError: ``params.engine`` is not a registered engine.
    """
    engine = engine_for(params.engine)
    base_url, server = pool.endpoint(label, params, cell, concurrency)  # the URL as given: credentials are sent
    shown_url = redact_credentials(base_url)  # ... and never shown nor stored (issue 42 item 1)
    where = f"see its log {server.log_path}" if server else f"at {shown_url}"
    unit = _Unit(label, params, engine, base_url, shown_url, server, where, pool, cell, concurrency)

    def tokenize(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def detokenize(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, clean_up_tokenization_spaces=False))

    bodies, prompt_checks = _bodies(unit, prompts, gen_length, stop_at_eos, tokenizer, tokenize)
    seed_of = seed * 1_000_003 + (batch_group or prompts[0].index)
    traffic = schedule(len(prompts), concurrency, params.request_rate, seed_of, params.burstiness)
    records, wall, group_metrics = _send(
        unit, bodies, traffic, tokenize, detokenize, token_bytes_of(tokenizer), gen_length, stop_at_eos
    )
    cell_load, steady = unit_load(
        failures.load_spans(records, gen_length),  # a failed request held its slot, brought no tokens (issue 59)
        wall,
        concurrency,
        params.request_rate,
    )
    cell_load.update(failures.unit_requests(records))  # requests sent and failed (issue 59 item 7)
    blocks = blocks_of(len(prompts), concurrency) if batch_group is not None else [()] * len(prompts)
    shared = {"cell_load": cell_load, "group_metrics": group_metrics or None, "group_wall_s": wall}
    observed: list[Observed] = []
    for r, (prompt, rec) in enumerate(zip(prompts, records)):
        if rec.error is not None:  # a failed request has no row: the unit's first row lists it (failures.py)
            continue
        tokens = _tokens(unit, rec, prompt, gen_length, stop_at_eos, len(tokenizer))
        try:
            spec = engine.acceptance(rec.counters, len(tokens))
        except DtbenchError as exc:
            raise unit.error(f"for prompt {prompt.index}: {exc}") from None
        ref = references[r] if references else None
        check = check_row(tokens, ref, prompt, params, reference, pool, cell, concurrency, rule)
        unit_stats = {
            **shared,
            "steady": steady[r],
            "arrival_s": traffic.delays[r],
            "prompt": prompt_checks[r],
            "lossless_rule": check.pop("lossless_rule"),
            **({} if observed else {"failed_requests": failures.failed_requests(records, prompts)}),
        }
        block = blocks[r]
        kept = failures.kept_rows(records, block)  # a block that lost a request is partial (issue 59 item 7)
        batch = Batch(prompts[block[0]].index, kept, block_wall(records, block)) if block else None
        observed.append(Observed(_served(unit, rec, tokens, spec, unit_stats), prompt, ref, batch, check))
    if server is not None and (code := server.exited()) is not None:
        raise ServerError(f"server '{label}' exited with code {code} during the cell; see its log {server.log_path}")
    return observed


def _bodies(
    unit: _Unit,
    prompts: list[Any],
    gen_length: int,
    stop_at_eos: bool,
    tokenizer: Any,
    tokenize: Callable[[str], list[int]],
) -> tuple[list[dict[str, Any]], list[str]]:
    """Per prompt its request body (the engine adapter's) and how its prompt was sent (``token ids sent``, or for a
    text prompt whether re-tokenizing its text gives the same ids)."""
    bodies, prompt_checks = [], []
    for p in prompts:
        ids = list(p.token_ids)
        if unit.params.prompt_format == "text":
            text = tokenizer.decode(ids)
            again = tokenize(text)
            prompt_checks.append(
                "equal" if again == ids else f"differs ({len(again)} tokens re-tokenized vs {len(ids)})"
            )
            bodies.append(unit.engine.request_body(unit.params, text, gen_length, stop_at_eos))
        else:
            prompt_checks.append("token ids sent")
            bodies.append(unit.engine.request_body(unit.params, ids, gen_length, stop_at_eos))
    return bodies, prompt_checks


def _tokens(unit: _Unit, rec: RequestRecord, prompt: Any, gen_length: int, stop_at_eos: bool, vocab: int) -> list[int]:
    """A request's first T tokens.

    Raises:
        ServerError: no token, fewer than T (unless it stopped at EOS as asked), or an id outside the target's
            vocabulary of ``vocab`` ids.
    """
    if not rec.reads or not rec.tokens:
        raise unit.error(f"sent no token for prompt {prompt.index}")
    if len(rec.tokens) < gen_length and not (stop_at_eos and rec.finish == "stop"):
        raise unit.error(
            f"sent {len(rec.tokens)} of {gen_length} tokens for prompt {prompt.index} (finish_reason {rec.finish!r})"
        )
    tokens = rec.tokens[:gen_length]
    if (bad := next((t for t in tokens if not 0 <= t < vocab), None)) is not None:
        # the ids the target's tokenizer cannot decode are no output (REST and EAGLE refuse them the same way)
        raise unit.error(
            f"sent token id {bad} for prompt {prompt.index}, outside the target's vocabulary (0..{vocab - 1}): is it "
            "serving another model?"
        )
    return tokens


def _served(
    unit: _Unit, rec: RequestRecord, tokens: list[int], spec: dict[str, Any], unit_stats: dict[str, Any]
) -> Served:
    """A request as the row builder's :class:`~dtbench.harness.measurement.observation.Served` observation, with the server's record
    (``step_stats.server``: the engine, the load, the latencies, the counters; ``unit_stats``: the unit's and this
    request's place in it)."""
    params, server = unit.params, unit.server
    times = [t for t, _ in rec.reads]
    server_stats = {
        "engine": params.engine,
        "base_url": unit.shown_url,
        "log": str(server.log_path) if server else None,
        "speculative": params.speculative,
        "concurrency": unit.concurrency,
        "request_rate": params.request_rate,
        "burstiness": params.burstiness,
        "load_kind": "steady",
        "steady": unit_stats["steady"],
        "cell_load": unit_stats["cell_load"],
        "arrival_s": unit_stats["arrival_s"],
        "sent_s": rec.sent_s,
        "e2e_s": times[-1],
        "ttft_s": times[0],
        "itl_s": [b - a for a, b in zip(times, times[1:])],
        "finish_reason": rec.finish,
        "prompt": unit_stats["prompt"],
        "counters": rec.counters,
        "acceptance": spec,
        "group_metrics": unit_stats["group_metrics"],
        "group_wall_s": unit_stats["group_wall_s"],
        "tokens_per_read": [n for _, n in rec.reads],
        "ids_recovered": rec.recovered,
        "resent": rec.resent,
        "lossless_rule": unit_stats["lossless_rule"],
    }
    if "failed_requests" in unit_stats:  # the unit's first row: its failed requests (issue 59 item 7)
        server_stats["failed_requests"] = unit_stats["failed_requests"]
    return Served(
        tokens=tokens,
        step_times=times,
        step_tokens=[n for _, n in rec.reads],
        drafted=spec.get("drafted") or 0,
        accepted=spec.get("accepted") or 0,
        steps=spec.get("steps"),
        stats={"server": server_stats},
    )
