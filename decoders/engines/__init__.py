"""Engine adapters (issue 40 item 3): one registered class per kind of server the ``server`` decoder measures.

A suite names its server's engine (``engine: vllm``); the harness asks the adapter registered under that name how to
write a request, read a streamed answer and the server's speculation counters (:class:`Engine`). Nothing branches
on an engine's name: an adapter's attributes (:attr:`Engine.metrics_path`, :attr:`Engine.schedules`) say what it
has.

Built-ins (:data:`BUILTIN`, declared in dtbench's own ``pyproject.toml`` under the entry-point group
:data:`ENGINES_GROUP` like a plugin's): ``llama.cpp``, ``vllm``, ``sglang``, ``openai`` (any other OpenAI-compatible
server) and ``trtllm``. A package adds an engine with one class (an :class:`OpenAICompatible` subclass, or any class
with :class:`Engine`'s members and a constructor without arguments) and one entry point::

    [project.entry-points."dtbench.engines"]
    my-engine = "my_pkg.engine:MyEngine"

The group is scanned on every lookup of a name that is not built in (a scan reads installed distributions' metadata,
no import) and each entry point is imported once, so an engine installed during a session is found at its next
lookup. A built-in name is never taken over; ``DTBENCH_DISABLE_PLUGINS=1`` keeps the built-ins only.
"""

from __future__ import annotations

import difflib
import os
from importlib.metadata import EntryPoint, entry_points

from dtbench.core import DtbenchError, clip
from dtbench.decoders.engines.base import Candidates, Chunk, Engine, OpenAICompatible, Span, candidate_id, count
from dtbench.decoders.engines.llama_cpp import LlamaCpp
from dtbench.decoders.engines.openai import OpenAI
from dtbench.decoders.engines.sglang import Sglang
from dtbench.decoders.engines.trtllm import TensorRTLLM
from dtbench.decoders.engines.vllm import Vllm

__all__ = [
    "BUILTIN",
    "ENGINES_GROUP",
    "Candidates",
    "Chunk",
    "Engine",
    "OpenAICompatible",
    "Span",
    "candidate_id",
    "count",
    "engine_for",
    "engine_names",
    "load_engine_plugins",
    "schedule_engines",
]

ENGINES_GROUP = "dtbench.engines"
BUILTIN: dict[str, type[OpenAICompatible]] = {
    "llama.cpp": LlamaCpp,
    "vllm": Vllm,
    "sglang": Sglang,
    "openai": OpenAI,
    "trtllm": TensorRTLLM,
}
BUILTIN_DISTRIBUTION = "dtbench"

_LOADED: dict[str, Engine] = {name: cls() for name, cls in BUILTIN.items()}  # name -> adapter (stateless)
_SEEN: dict[tuple[str, str, str], str | None] = {}  # (name, value, distribution) -> its problem, None when loaded
_AMBIGUOUS: dict[str, list[str]] = {}  # a name two distributions register -> their names (unusable)


def load_engine_plugins() -> list[str]:
    """Import every engine adapter a package registers under :data:`ENGINES_GROUP` (see the module docstring).

    Returns:
        One line per registration first found unusable in this call (it failed to import, is no :class:`Engine`,
        claims a built-in name, or shares its name with another distribution's); the others are registered.
    """
    if os.environ.get("DTBENCH_DISABLE_PLUGINS", "") not in ("", "0"):
        return []
    problems: list[str] = []
    for ep in entry_points(group=ENGINES_GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        key = (ep.name, ep.value, dist)
        if key in _SEEN or (ep.name in BUILTIN and dist == BUILTIN_DISTRIBUTION):
            continue
        problem = _register(ep.name, ep, dist)
        _SEEN[key] = problem
        if problem:
            problems.append(problem)
    return problems


def _register(name: str, ep: EntryPoint, dist: str) -> str | None:
    """Load one entry point and register its adapter under ``name``; the problem's line, or None."""
    what = f"engine '{clip(name, 80)}' from distribution {dist}"
    if name in BUILTIN:
        return f"{what} refused: '{name}' is a built-in engine of dtbench"
    owners = [d for (n, _, d), problem in _SEEN.items() if n == name and problem is None and d != dist]
    if owners:
        _AMBIGUOUS[name] = sorted({*owners, dist})
        _LOADED.pop(name, None)
        return f"{what}: '{name}' is also registered by {', '.join(owners)}; uninstall one to use it"
    try:
        cls = ep.load()
        adapter = cls() if isinstance(cls, type) else None
    except Exception as exc:  # a broken plugin is named, never the end of the run
        return f"{what} cannot be loaded: {type(exc).__name__}: {clip(exc, 200)}"
    if not isinstance(adapter, Engine):
        return f"{what} is {clip(repr(cls), 80)}, not an engine adapter (dtbench.decoders.engines.Engine)"
    _LOADED[name] = adapter
    return None


def engine_names() -> tuple[str, ...]:
    """The registered engines' names: the built-ins in their order, then the plugins' (sorted)."""
    load_engine_plugins()
    return (*BUILTIN, *sorted(n for n in _LOADED if n not in BUILTIN))


def engine_for(name: str) -> Engine:
    """The adapter registered as ``name``.

    Raises:
        DtbenchError: an unknown name (one line, with the closest registered names), a name two distributions
            register, or a plugin that could not be loaded (its problem).
    """
    if name in BUILTIN:
        return _LOADED[name]
    load_engine_plugins()
    if name in _LOADED:
        return _LOADED[name]
    if name in _AMBIGUOUS:
        raise DtbenchError(
            f"engine '{name}' is registered by {' and '.join(_AMBIGUOUS[name])}; uninstall one to use it"
        )
    failed = next((p for (n, _, _), p in _SEEN.items() if n == name and p), None)
    if failed:
        raise DtbenchError(failed)
    names = engine_names()
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise DtbenchError(f"unknown engine {clip(name, 80)!r}{hint} (registered: {', '.join(names)})")


def schedule_engines() -> tuple[str, ...]:
    """The registered engines that state a speculation schedule (:attr:`Engine.schedules`), in
    :func:`engine_names` order."""
    return tuple(n for n in engine_names() if _LOADED[n].schedules)
