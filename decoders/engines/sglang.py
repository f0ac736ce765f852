"""``sglang``: SGLang's OpenAI-compatible server.

The prompt as token ids; per request ``meta_info.spec_verify_ct`` and ``completion_tokens`` (SGLang's accept length =
completion tokens / verify count, as its ``test/srt/test_eagle_infer.py`` computes it). Its speculation schedule:
one ``--speculative-num-steps`` per server, given per batch-size bucket for a launcher that picks the server by load.
"""

from __future__ import annotations

from typing import Any, ClassVar

from dtbench.core import DtbenchError
from dtbench.decoders.engines.base import Chunk, OpenAICompatible, Span, count

META = ("spec_verify_ct", "completion_tokens", "spec_accept_length", "spec_accept_token_num", "spec_draft_token_num")


class Sglang(OpenAICompatible):
    """SGLang: speculation through each response's ``meta_info``."""

    schedules: ClassVar[bool] = True

    def stream_fields(self, stop_at_eos: bool) -> dict[str, Any]:
        """EOS ignored unless asked; ``meta_info`` in the response (``return_meta_info``)."""
        return {"ignore_eos": not stop_at_eos, "return_meta_info": True}

    def read(self, event: dict[str, Any], choice: dict[str, Any], chunk: Chunk) -> None:
        """``meta_info`` (of the choice, or of the event) as ``sglang:<name>`` counters."""
        meta = choice.get("meta_info") or event.get("meta_info")
        if isinstance(meta, dict):
            for key in META:
                if meta.get(key) is not None:
                    chunk.counters[f"sglang:{key}"] = float(meta[key])

    def acceptance(self, counters: dict[str, float], new_tokens: int) -> dict[str, Any]:
        """``spec_verify_ct`` steps; accept length = completion tokens / steps (SGLang's own definition); accepted =
        ``spec_accept_token_num`` where sent, else tokens - steps. {} without ``spec_verify_ct``.

        Raises:
            DtbenchError: a counter that is no count, more steps or accepted tokens than tokens, or more accepted
                than drafted.
        """
        if "sglang:spec_verify_ct" not in counters:
            return {}
        steps = count(counters, "sglang:spec_verify_ct")
        tokens = count(counters, "sglang:completion_tokens", new_tokens)
        accepted = (
            count(counters, "sglang:spec_accept_token_num")
            if "sglang:spec_accept_token_num" in counters
            else max(tokens - steps, 0)
        )
        drafted = count(counters, "sglang:spec_draft_token_num") if "sglang:spec_draft_token_num" in counters else None
        if steps > tokens or accepted > tokens or (drafted is not None and accepted > drafted):
            raise DtbenchError(
                f"its speculation counters are impossible: spec_verify_ct {steps}, accepted {accepted}, drafted "
                f"{drafted} for {tokens} tokens (a verification step commits at least one token)"
            )
        return {
            "source": "sglang meta_info.spec_verify_ct",
            "drafted": drafted,
            "accepted": accepted,
            "steps": steps,
            "acceptance_length": tokens / steps if steps else None,
            "steps_rule": "reported: spec_verify_ct",
        }

    def schedule(self, spans: list[Span]) -> dict[str, Any] | None:
        """Per batch-size bucket ``--speculative-num-steps`` K and ``--speculative-num-draft-tokens`` K + 1 (chain
        drafting, top-k 1; 0 where speculation does not pay)."""
        return {
            "per_batch_bucket": [
                {
                    "batch_sizes": f"{lo}-{hi}",
                    "speculative_num_steps": k,
                    "speculative_num_draft_tokens": k + 1 if k else 0,
                }
                for lo, hi, k in spans
            ]
        }
