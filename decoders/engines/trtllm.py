"""``trtllm``: TensorRT-LLM's ``trtllm-serve`` (an OpenAI-compatible server), the engine of one file an adapter needs.

Requests as in the OpenAI format plus ``ignore_eos`` (``tensorrt_llm/serve/openai_protocol.py``,
``CompletionRequest``: unknown fields are refused there, so nothing else is sent); token ids read from
``choices[0].token_ids`` where the server sends them, else the text is re-tokenized; no speculation counters are read.
Its speculation schedule: ``speculative_config.draft_len_schedule`` as merged in NVIDIA/TensorRT-LLM PR #10860
(``{4: 4, 8: 2, 32: 1}`` = K 4 up to B 4, 2 up to 8, 1 up to 32, none above).

A third-party adapter is the same: a class like this one in a package, and one line in its ``pyproject.toml``::

    [project.entry-points."dtbench.engines"]
    my-engine = "my_pkg.engine:MyEngine"
"""

from __future__ import annotations

from typing import Any, ClassVar

from dtbench.decoders.engines.base import Chunk, OpenAICompatible, Span


class TensorRTLLM(OpenAICompatible):
    """TensorRT-LLM's ``trtllm-serve``: OpenAI requests with ``ignore_eos``; its ``draft_len_schedule``."""

    schedules: ClassVar[bool] = True

    def stream_fields(self, stop_at_eos: bool) -> dict[str, Any]:
        """EOS ignored unless asked (``ignore_eos``)."""
        return {"ignore_eos": not stop_at_eos}

    def read(self, event: dict[str, Any], choice: dict[str, Any], chunk: Chunk) -> None:
        """``choices[0].token_ids`` where sent (``CompletionResponseStreamChoice.token_ids``)."""
        if isinstance(choice.get("token_ids"), list):
            chunk.tokens = [int(t) for t in choice["token_ids"]]

    def schedule(self, spans: list[Span]) -> dict[str, Any] | None:
        """``draft_len_schedule`` {largest B of each range: K}, the ranges after the last K > 0 left out (no
        speculation above them)."""
        last = max((i for i, (_, _, k) in enumerate(spans) if k > 0), default=-1)
        return {"speculative_config": {"draft_len_schedule": {hi: k for lo, hi, k in spans[: last + 1]}}}
