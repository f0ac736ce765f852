"""``vllm``: vLLM's OpenAI-compatible server.

The prompt as token ids; ``return_token_ids`` (``choices[].token_ids``) or, in older versions, ``logprobs`` with
``return_tokens_as_token_ids`` (``token_id:N`` keys); Prometheus ``/metrics`` counters
``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and
``..._num_accepted_tokens_per_pos_total{position}`` (``vllm/v1/spec_decode/metrics.py``, ``SpecDecodingProm``), read
before and after each unit of requests and differenced. Its speculation schedule: one ``num_speculative_tokens`` and
``disable_by_batch_size`` (``speculative_config``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from dtbench.core import DtbenchError
from dtbench.decoders.engines.base import Chunk, OpenAICompatible, Span, count

COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


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
    wanted = {v: k for k, v in COUNTERS.items()}
    try:
        for family in text_string_to_metric_families(text):
            if family.name in wanted:
                out[wanted[family.name]] = sum(s.value for s in family.samples if s.name.endswith("_total"))
            elif family.name == PER_POS:
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
    for key in COUNTERS:
        if key in after:
            out[key] = after[key] - before.get(key, 0.0)
    if "accepted_per_pos" in after:
        b = before.get("accepted_per_pos", [])
        out["accepted_per_pos"] = [a - (b[i] if i < len(b) else 0.0) for i, a in enumerate(after["accepted_per_pos"])]
    for key, value in [
        *((k, out[k]) for k in COUNTERS if k in out),
        *(("accepted_per_pos", v) for v in out.get("accepted_per_pos", [])),
    ]:
        count({key: value}, key)
    if out.get("accepted", 0) > out.get("draft_tokens", math.inf):
        raise DtbenchError(
            f"its /metrics counters are impossible: {out['accepted']:g} accepted of {out['draft_tokens']:g} draft tokens"
        )
    return out


class Vllm(OpenAICompatible):
    """vLLM: token ids through ``return_token_ids``, speculation through ``/metrics`` per unit of requests."""

    metrics_path: ClassVar[str | None] = "/metrics"
    schedules: ClassVar[bool] = True

    def stream_fields(self, stop_at_eos: bool) -> dict[str, Any]:
        """EOS ignored unless asked; the token ids of each event (``return_token_ids``)."""
        return {"ignore_eos": not stop_at_eos, "return_token_ids": True}

    def top_fields(self, n: int) -> dict[str, Any]:
        """``logprobs`` with candidates keyed ``token_id:N`` (``return_tokens_as_token_ids``)."""
        return {"logprobs": n, "return_tokens_as_token_ids": True}

    def read(self, event: dict[str, Any], choice: dict[str, Any], chunk: Chunk) -> None:
        """``choices[0].token_ids`` (``return_token_ids``), which replace ids read from ``logprobs``."""
        if isinstance(choice.get("token_ids"), list):
            chunk.tokens = [int(t) for t in choice["token_ids"]]

    def parse_metrics(self, text: str) -> dict[str, Any]:
        """See :func:`parse_metrics`."""
        return parse_metrics(text)

    def metrics_delta(self, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        """See :func:`metrics_delta`."""
        return metrics_delta(before, after)

    def schedule(self, spans: list[Span]) -> dict[str, Any] | None:
        """vLLM takes one ``num_speculative_tokens`` (the K of the first range) and ``disable_by_batch_size``: the
        first batch size predicted not to pay (None when every calibrated B pays). Where no K pays at the first range
        (K 0 there: vLLM cannot speculate above a batch size only), the schedule is not to speculate, in vLLM's terms:
        no ``speculative_config`` (``num_speculative_tokens: 0`` is no setting vLLM takes; issue 50 item 5e)."""
        stop = next((lo for lo, _, k in spans if k == 0), None)
        first = spans[0][2] if spans else 0
        if first == 0:
            return {
                "speculative_config": None,
                "do_not_speculate": "serve without --speculative-config: no K is predicted to pay at the smallest "
                "batch size",
            }
        return {"speculative_config": {"num_speculative_tokens": first, "disable_by_batch_size": stop}}
