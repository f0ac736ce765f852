"""Measuring a server through requests (issue 30): a decoder that declares
:attr:`~dtbench.decoders.base.Decoder.requests` (``server``) is measured here instead of through ``generate()``; the
harness still owns the clock, exactly as :mod:`dtbench.harness.measure` owns it for dtbench's own loops.

The package by its seams (issue 40 item 3):

- :mod:`~dtbench.harness.serving.process`: the servers a worker launches (:class:`ServerPool`): process groups, logs,
  health, stop; :class:`ServerError`, the one-line error naming a server and its log.
- :mod:`~dtbench.harness.serving.client`: one unit of a cell through the bounded async client
  (:func:`measure_requests`): the requests, the clock, each request's observation handed to
  :func:`~dtbench.harness.metrics.sample_row`, the one row builder.
- :mod:`~dtbench.harness.serving.record`: what the client saw of a request (:class:`RequestRecord`) and the
  recovery of token ids a stream held back (:func:`~dtbench.harness.serving.record.recover_ids`).
- :mod:`~dtbench.harness.serving.traffic`: arrival processes (:func:`arrival_delays`), the load profile
  (:func:`load_profile`) and the blocks of C prompts a speedup pairs (:func:`blocks_of`).
- :mod:`~dtbench.harness.serving.check`: the output check against the reference server (:func:`check_request`), with
  the one tie rule of :mod:`dtbench.harness.lossless`.

How a request is written and its answer read is the engine adapter's (:mod:`dtbench.decoders.engines`), never a
branch on the engine's name. The names other modules import are re-exported here.
"""

from __future__ import annotations

from dtbench.harness.serving.check import candidate_shapes, check_request, top_candidates
from dtbench.harness.serving.client import RequestRecord, block_wall, measure_requests, sse_events
from dtbench.harness.serving.process import (
    HOST,
    LLAMA_SERVER_ENV,
    LOG_DIR_ENV,
    MAKE_ENGINE,
    STOP_GRACE_S,
    Launched,
    ServerError,
    ServerPool,
    free_port,
    launches_llama_server,
    llama_server_binary,
    port_taken,
)
from dtbench.harness.serving.traffic import (
    ARRIVALS,
    arrival_delays,
    arrival_process,
    blocks_of,
    load_profile,
    steady_throughput,
)

check_output = check_request  # the name before issue 40 (harness/lossless.py has its own check_output)
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
    "ServerError",
    "ServerPool",
    "arrival_delays",
    "arrival_process",
    "block_wall",
    "blocks_of",
    "candidate_shapes",
    "check_output",
    "check_request",
    "free_port",
    "launches_llama_server",
    "llama_server_binary",
    "load_profile",
    "measure_requests",
    "port_taken",
    "sse_events",
    "steady_throughput",
    "top_candidates",
]
