"""``server``: speculative decoding as deployed, measured through an OpenAI-compatible completions endpoint (issue 30).

The entry is a *served* declaration (family ``external``, capability :attr:`~dtbench.decoders.base.Decoder.requests`):
where the server is (``base_url:``, or ``launch:``, a command the harness starts for the cell in its own process
group), how a request is written and how its streamed response and the server's counters are read, per engine. The
harness (:mod:`dtbench.harness.serving`) owns the process, the bounded async client and the clock, as it owns the
clock of every other decoder.

How a server cell is registered (issue 49 item 1): still through the decoders' registry (entry point ``server`` in
the group ``dtbench.decoders``), as a :class:`~dtbench.decoders.base.Decoder` subclass *without* ``generate`` (an
abstract class: it cannot be instantiated, so nothing can run it as a decoder) whose ``requests`` flag selects the
served measurer. Why not a separate kind of entry: a suite's ``decoders:`` list, the plan, the validation
(:mod:`dtbench.harness.suites.plan_checks`, the preflight), calibration and the reports read every entry through the same
capability class methods (``Params``, ``reference``, ``verify_sizes``, ``lossless_with``, ``batching_error``,
``corpus_of``, ...) and one registry policy; a second registry or a non-Decoder class would duplicate all of them
for one entry. What was wrong before was a Decoder whose ``generate`` raised: now the measurer is chosen by the flag
(:func:`dtbench.harness.measurement.measurers.measurer_name`) and stored with the cell (``cells.measurer``), and the class
cannot be run. Its params (:class:`~dtbench.decoders.engines.params.ServerParams`) belong to the serving layer and
are re-exported here under their old names.

Engines (``engine:``): an adapter registered by name (:mod:`dtbench.decoders.engines`: ``llama.cpp``, ``vllm``,
``sglang``, ``openai``, ``trtllm``, or one a package registers under the ``dtbench.engines`` entry-point group) writes
the requests and reads the answers and counters where that engine's documentation or source says they are. The
functions below (:func:`request_body`, :func:`top_body`, :func:`parse_chunk`, :func:`request_acceptance`,
:func:`parse_metrics`, :func:`metrics_delta`) are those adapters' methods by engine name.

Two acceptance means, both labelled (they differ: vLLM issue 42690): *per step* = committed tokens over target
verification steps pooled over every request of the cell (vLLM's ``1 + accepted / drafts``), *per request* = the mean
over requests of each request's own ratio.
"""

from __future__ import annotations

import json
from typing import Any

from dtbench.core import redact_credentials
from dtbench.decoders.base import Decoder
from dtbench.decoders.engines import Chunk, engine_for
from dtbench.decoders.engines.llama_cpp import LLAMA_SERVER
from dtbench.decoders.engines.openai import OpenAI
from dtbench.decoders.engines.params import LAUNCH_PLACEHOLDERS, ServerParams, auth_headers, literal_credential
from dtbench.decoders.engines.vllm import COUNTERS as VLLM_COUNTERS
from dtbench.decoders.engines.vllm import PER_POS as VLLM_PER_POS
from dtbench.decoders.engines.vllm import metrics_delta, parse_metrics

__all__ = [
    "PLACEHOLDERS",
    "VLLM_COUNTERS",
    "VLLM_PER_POS",
    "Chunk",
    "Server",
    "ServerParams",
    "auth_headers",
    "describe",
    "literal_credential",
    "metrics_delta",
    "parse_chunk",
    "parse_metrics",
    "request_acceptance",
    "request_body",
    "top_body",
]
PLACEHOLDERS = (*LAUNCH_PLACEHOLDERS, LLAMA_SERVER)  # the name before issue 49: the harness's and llama.cpp's


def request_body(params: ServerParams, prompt: list[int] | str, max_tokens: int, stop_at_eos: bool) -> dict[str, Any]:
    """The JSON body of one streamed, greedy ``/v1/completions`` request: the ``params.engine`` adapter's
    (:meth:`~dtbench.decoders.engines.OpenAICompatible.request_body`).

    Raises:
        DtbenchError: the engine is not registered.
    """
    return engine_for(params.engine).request_body(params, prompt, max_tokens, stop_at_eos)


def top_body(params: ServerParams, prompt: list[int], n: int, tokens: int = 1) -> dict[str, Any]:
    """The body of one non-streamed check request (the top ``n`` candidates of the next ``tokens`` tokens): the
    ``params.engine`` adapter's (:meth:`~dtbench.decoders.engines.OpenAICompatible.top_body`).

    Raises:
        DtbenchError: the engine is not registered.
    """
    return engine_for(params.engine).top_body(params, prompt, n, tokens)


def parse_chunk(engine: str, event: dict[str, Any]) -> Chunk:
    """One server-sent event's JSON (``data: {...}``) as a :class:`~dtbench.decoders.engines.Chunk`, read by the
    ``engine`` adapter (:meth:`~dtbench.decoders.engines.OpenAICompatible.parse_event`).

    Raises:
        DtbenchError: the event is an error object (``{"error": ...}``), or the engine is not registered.
    """
    return engine_for(engine).parse_event(event)


def request_acceptance(counters: dict[str, float], new_tokens: int) -> dict[str, Any]:
    """One response's server-reported speculation from whichever built-in engine's counters it carries (llama.cpp's
    ``timings``, SGLang's ``meta_info``; the ``openai`` adapter's reading): drafted and accepted tokens, verification
    steps and the request's acceptance length (tokens per target verification step, the bonus token included).

    Returns:
        ``{"source", "drafted", "accepted", "steps", "acceptance_length", "steps_rule"}`` (values None where the
        source does not say), or {} when the response carried no speculation counters.

    Raises:
        DtbenchError: a counter that is no count (NaN, infinite, negative, fractional) or counters that contradict
            each other or the tokens received: the server's numbers are never stored as measured (issue 42 item 4).
    """
    return OpenAI().acceptance(counters, new_tokens)


class Server(Decoder[ServerParams]):
    """An OpenAI-compatible server under benchmark: a plain one (the reference) or a speculating one.

    A *served* entry: a declaration the plan, validation and reports read (its params, capabilities and reference),
    never a decoder that runs. It has no :meth:`generate` (it stays abstract, so it cannot be instantiated): the
    harness's served measurer (:mod:`dtbench.harness.serving.measurer`) measures it through requests, chosen by its
    ``requests`` capability; the server owns the model, dtbench's own target only tokenizes the prompts. Its load
    level (the suite's ``concurrency:``, the same axis as ``batch_sizes:``) is the number of requests in flight. Its
    reference is the server of ``params.reference`` (the same engine without speculation); without one it is a
    reference itself.
    """

    Params = ServerParams
    family = "external"
    lossless = True  # at T = 0 a speculating server's output must equal its plain server's, request by request
    batching = True  # load levels above 1: requests in flight at once
    requests = True
    version = "2"  # 2: steady concurrency over the cell's prompts, arrivals over the dataset (issue 39)

    @classmethod
    def reference(cls, params: ServerParams) -> tuple[str, dict[str, Any]] | None:
        """The plain server of ``params.reference`` (same engine, no speculation), under the same load: it takes this
        server's ``request_rate`` and ``burstiness`` where it sets none of its own (a rate sweep pairs each rate's
        cell with its plain server at that rate); None: a reference itself."""
        if params.reference is None:
            return None
        ref = dict(params.reference)
        for key in ("request_rate", "burstiness"):
            if key not in ref and key in params.model_fields_set:
                ref[key] = getattr(params, key)
        return "server", ref

    @classmethod
    def verify_sizes(cls, params: ServerParams) -> tuple[int, int]:
        """Nothing for dtbench's calibration to measure: the server runs its own forwards."""
        return 0, 0


def describe(params: ServerParams) -> str:
    """A short name of the server for one-line errors: its base URL (credentials masked) or its launch command's
    program."""
    if params.base_url:
        return redact_credentials(params.base_url)
    return json.dumps(params.launch[0] if params.launch else "")
