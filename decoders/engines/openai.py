"""``openai``: any other OpenAI-compatible server (text prompts work; ``prompt_format: text`` has the harness check
the prompt's tokenization).

The OpenAI format, and where a server sends them the fields of the built-in engines' dialects (vLLM's
``token_ids``, llama.cpp's ``__verbose`` and ``timings``, SGLang's ``meta_info``), read as those adapters read them:
a llama.cpp or SGLang server named ``openai`` still reports its speculation counters. Nothing else is asked of it.
"""

from __future__ import annotations

from typing import Any

from dtbench.decoders.engines.base import Chunk, OpenAICompatible
from dtbench.decoders.engines.llama_cpp import LlamaCpp
from dtbench.decoders.engines.sglang import Sglang
from dtbench.decoders.engines.vllm import Vllm


class OpenAI(OpenAICompatible):
    """A plain OpenAI-compatible server: OpenAI requests; the built-in dialects' fields read where present."""

    dialects: tuple[OpenAICompatible, ...] = (Vllm(), LlamaCpp(), Sglang())  # in the order their fields are read

    def read(self, event: dict[str, Any], choice: dict[str, Any], chunk: Chunk) -> None:
        """Every dialect's fields, in :attr:`dialects` order (a later one's token ids replace an earlier one's)."""
        for dialect in self.dialects:
            dialect.read(event, choice, chunk)

    def acceptance(self, counters: dict[str, float], new_tokens: int) -> dict[str, Any]:
        """The first dialect whose counters the response carried (llama.cpp's ``timings``, then SGLang's
        ``meta_info``); {} when none.

        Raises:
            DtbenchError: as that dialect's :meth:`~OpenAICompatible.acceptance`.
        """
        for dialect in self.dialects:
            found = dialect.acceptance(counters, new_tokens)
            if found:
                return found
        return {}
