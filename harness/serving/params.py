"""A server cell's params as the serving layer reads them (issue 49 item 4): :class:`ServerParams` (where the server
is, how it is started and asked, its reference) and :func:`auth_headers` (the API key's header), and how a ``launch:``
command's placeholders are resolved (:func:`launch_argv`).

The params model itself is defined beside the engine adapters (:mod:`dtbench.decoders.engines.params`) because the
``server`` entry, in the decoder layer, declares it as its ``Params`` and that layer imports nothing of the harness;
every harness module reads it from here, never from :mod:`dtbench.decoders.server`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from dtbench.decoders.engines import engine_for
from dtbench.decoders.engines.params import (
    LAUNCH_PLACEHOLDERS,
    ServerParams,
    auth_headers,
    literal_credential,
    tls_context,
)

__all__ = [
    "LAUNCH_PLACEHOLDERS",
    "ServerParams",
    "auth_headers",
    "engine_placeholders",
    "launch_argv",
    "literal_credential",
    "tls_context",
]


def engine_placeholders(params: ServerParams) -> dict[str, Callable[[], str]]:
    """The launch placeholders of the server's engine adapter (``{llama_server}`` for llama.cpp), each with its
    resolver (:meth:`~dtbench.decoders.engines.OpenAICompatible.placeholders`; {} for an adapter without them).

    Raises:
        DtbenchError: ``params.engine`` is not a registered engine.
    """
    placeholders = getattr(engine_for(params.engine), "placeholders", None)
    return dict(placeholders()) if placeholders is not None else {}


def launch_argv(params: ServerParams, values: Mapping[str, str], model: Callable[[], str]) -> list[str]:
    """``params.launch`` with its placeholders replaced: the engine's own (resolved only where used), ``{model}`` by
    ``model()`` (only where used) and the harness's ``values`` (``port``, ``host``, ``concurrency``: ``{name}`` ->
    value).

    Raises:
        DtbenchError: an engine placeholder that cannot be resolved (e.g. no llama-server: one line naming
            ``make engine``), or an unregistered engine.
    """
    own = engine_placeholders(params)
    argv = []
    for arg in params.launch or []:
        if "{model}" in arg:
            arg = arg.replace("{model}", model())
        for name, resolve in own.items():
            if name in arg:
                arg = arg.replace(name, resolve())
        for k, v in values.items():
            arg = arg.replace("{" + k + "}", v)
        argv.append(arg)
    return argv
