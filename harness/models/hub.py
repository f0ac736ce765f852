"""The Hugging Face hub, asked once: an unreachable hub is found with one short request, then the process works
from the local cache (offline mode) instead of letting every download retry.

Without the offline variables (``HF_HUB_OFFLINE``) and without a network, huggingface_hub retries each request five
times with backoff, logging two lines per try: 22 lines and 50 s before a model's one-line error, 11 lines and 30 s
for a dataset. :func:`prepare` probes the hub's endpoint once per process (one HEAD request, ``PROBE_TIMEOUT_S``)
and, when nothing answers, switches huggingface_hub, transformers and datasets to offline mode for the rest of the
process, so loads read the cache or fail at once; :func:`quiet` keeps the libraries' own log lines (retries,
warnings) off the terminal while dtbench loads, since dtbench reports each failure as one line itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

PROBE_TIMEOUT_S = 5.0
_REACHABLE: dict[str, bool] = {}  # endpoint -> answered (this process)
_LOGGERS = ("huggingface_hub", "datasets", "fsspec", "httpx", "httpcore")


def offline() -> bool:
    """Whether huggingface_hub is in offline mode (the variables, or :func:`prepare` found no hub)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def reachable(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether anything answers HTTP at ``endpoint`` within ``timeout_s`` (any status counts), asked once."""
    if endpoint not in _REACHABLE:
        import urllib.error
        import urllib.request

        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s).close()
            _REACHABLE[endpoint] = True
        except urllib.error.HTTPError:  # an answer, even 4xx/5xx: the network works
            _REACHABLE[endpoint] = True
        except (OSError, ValueError):  # refused, unreachable, DNS failure, timeout, a malformed endpoint
            _REACHABLE[endpoint] = False
    return _REACHABLE[endpoint]


def prepare() -> None:
    """Before a hub download: if the hub does not answer, go offline (cache only) for the rest of this process.

    Sets ``huggingface_hub.constants.HF_HUB_OFFLINE`` (what huggingface_hub and transformers consult on every
    request), ``datasets.config.HF_HUB_OFFLINE`` when datasets is loaded, and ``HF_HUB_OFFLINE=1`` in the
    environment (for libraries imported later and processes started from this one).
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or reachable(constants.ENDPOINT):
        return
    constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets.config

        datasets.config.HF_HUB_OFFLINE = True
    except ImportError:
        pass


@contextmanager
def quiet() -> Iterator[None]:
    """Keep the hub libraries' log lines below ERROR while dtbench loads (each failure becomes dtbench's one line)."""
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, before):
            lg.setLevel(level)
