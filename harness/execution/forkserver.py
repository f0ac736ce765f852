"""The one fork server the conformance kit's children and the plugins' import probes start from (issue 65, issue 67
item 5): a leaf module (the standard library only), so whoever starts a child names the fork server without importing
the kit (:mod:`dtbench.registry` probes plugins through it; an import of the kit there would close a cycle)."""

from __future__ import annotations

import functools
import multiprocessing
from typing import Any

PRELOAD = ["dtbench.testing.preload"]  # what the fork server imports once (torch, transformers, the kit)


@functools.cache
def context() -> Any:
    """The multiprocessing context children start from: a fork server that imported torch, transformers and the kit
    once (:data:`PRELOAD`), so a decoder's child starts without those seconds of imports, yet from a process that ran
    no check and holds no CUDA state; *spawn* where the platform has no fork server. The fork server ends with this
    process. A child takes the caller's environment and current folder with its decoder (the fork server's are
    those of its start), and its ``sys.path`` from multiprocessing's preparation data."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
