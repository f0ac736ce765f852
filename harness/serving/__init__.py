"""Measuring a server through requests (issue 30): an entry that declares
:attr:`~dtbench.decoders.base.Decoder.requests` (``server``) is measured here by the served measurer; the
harness still owns the clock, exactly as :mod:`dtbench.harness.measurement.measure` owns it for dtbench's own loops.

The package by its seams (issue 40 item 3):

- :mod:`~dtbench.harness.serving.params`: a server cell's params (:class:`ServerParams`, defined beside the engine
  adapters), its API key's header, a ``launch:`` command's placeholders (the harness's and its engine adapter's).
- :mod:`~dtbench.harness.serving.measurer`: the served :class:`~dtbench.harness.measurement.measurers.Measurer` (a cell's unit
  through the client, then the shared tail of every cell).
- :mod:`~dtbench.harness.serving.process`: the servers a worker launches (:class:`ServerPool`): process groups, logs,
  health, stop; :class:`ServerError`, the one-line error naming a server and its log.
- :mod:`~dtbench.harness.serving.client`: one unit of a cell through the bounded async client
  (:func:`observe_requests`): the requests, the clock, each request's observation (rows by the shared tail,
  :func:`~dtbench.harness.measurement.measurers.record_rows`, as every cell's).
- :mod:`~dtbench.harness.serving.record`: what the client saw of a request (:class:`RequestRecord`) and the
  recovery of token ids a stream held back (:func:`~dtbench.harness.serving.record.recover_ids`).
- :mod:`~dtbench.harness.serving.traffic`: arrival processes (:func:`arrival_delays`), a unit's :class:`Schedule` and
  its :func:`dispatch` (concurrency and arrivals, apart from the request code), the load profile
  (:func:`load_profile`) and the blocks of C prompts a speedup pairs (:func:`blocks_of`).
- :mod:`~dtbench.harness.serving.check`: the output check against the reference server (:func:`check_request`), with
  the one tie rule of :mod:`dtbench.harness.measurement.lossless`.

How a request is written and its answer read is the engine adapter's (:mod:`dtbench.decoders.engines`), never a
branch on the engine's name. The names other modules import are re-exported here.
"""

from __future__ import annotations

from dtbench.harness.serving.check import candidate_shapes, check_request, top_candidates
from dtbench.harness.serving.client import RequestRecord, block_wall, observe_requests, sse_events
from dtbench.harness.serving.params import ServerParams, auth_headers, launch_argv
from dtbench.harness.serving.process import (
    HOST,
    LLAMA_SERVER_ENV,
    LOG_DIR_ENV,
    MAKE_ENGINE,
    STOP_GRACE_S,
    Launched,
    ServerError,
    ServerPool,
    check_launch,
    free_port,
    launches_llama_server,
    llama_server_binary,
    port_taken,
)
from dtbench.harness.serving.traffic import (
    ARRIVALS,
    Schedule,
    arrival_delays,
    arrival_process,
    blocks_of,
    dispatch,
    load_profile,
    schedule,
    steady_throughput,
)

check_output = check_request  # the name before issue 40 (harness/measurement/lossless.py has its own check_output)
_events = sse_events  # the name before issue 40 (tests/test_server_formats.py)

__all__ = [
    "ARRIVALS",
    "HOST",
    "LLAMA_SERVER_ENV",
    "LOG_DIR_ENV",
    "MAKE_ENGINE",
    "STOP_GRACE_S",
    "Launched",
    "RequestRecord",
    "Schedule",
    "ServerError",
    "ServerParams",
    "ServerPool",
    "arrival_delays",
    "arrival_process",
    "auth_headers",
    "block_wall",
    "blocks_of",
    "candidate_shapes",
    "check_launch",
    "check_output",
    "check_request",
    "dispatch",
    "free_port",
    "launch_argv",
    "launches_llama_server",
    "llama_server_binary",
    "load_profile",
    "observe_requests",
    "port_taken",
    "schedule",
    "sse_events",
    "steady_throughput",
    "top_candidates",
]
