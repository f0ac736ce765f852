"""Engine adapters (issue 40 item 3): one registered class per kind of server the ``server`` decoder measures.

A suite names its server's engine (``engine: vllm``); the harness asks the adapter registered under that name how to
write a request, read a streamed answer and the server's speculation counters (:class:`Engine`). Nothing branches
on an engine's name: an adapter's attributes (:attr:`Engine.metrics_path`, :attr:`Engine.schedules`) say what it
has.

Built-ins (declared only in dtbench's own ``pyproject.toml`` under the entry-point group :data:`ENGINES_GROUP`,
like a plugin's): ``llama.cpp``, ``vllm``, ``sglang``, ``openai`` (any other OpenAI-compatible server) and ``trtllm``.
A package adds an engine with one class (an :class:`OpenAICompatible` subclass, or any class with :class:`Engine`'s
members and a constructor without arguments) and one entry point::

    [project.entry-points."dtbench.engines"]
    my-engine = "my_pkg.engine:MyEngine"

The group is read by the one :class:`~dtbench.registry.Registry` (:data:`REGISTRY`) and its policy: scanned on every
lookup (metadata only, no import), each entry imported once, a built-in name never taken over, two distributions
claiming one name ambiguous, ``DTBENCH_DISABLE_PLUGINS=1`` keeping the built-ins only.
"""

from __future__ import annotations

from dtbench.core import DtbenchError
from dtbench.decoders.engines.base import Candidates, Chunk, Engine, OpenAICompatible, Span, candidate_id, count
from dtbench.registry import Expect, Registry

__all__ = [
    "ENGINES_GROUP",
    "REGISTRY",
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


def _is_adapter_class(obj: object) -> bool:
    """A class whose instances are :class:`Engine` adapters (checked on an instance: a Protocol with attributes
    cannot be checked with issubclass)."""
    if not isinstance(obj, type):
        return False
    try:
        return isinstance(obj(), Engine)
    except Exception:  # a constructor that needs arguments or fails is no adapter class
        return False


REGISTRY: Registry[type[Engine]] = Registry(
    ENGINES_GROUP, "engine", Expect(_is_adapter_class, "an engine adapter class (dtbench.decoders.engines.Engine)")
)
_ADAPTERS: dict[type[Engine], Engine] = {}  # class -> its one (stateless) adapter


def load_engine_plugins() -> list[str]:
    """Load every registered engine (see the module docstring).

    Returns:
        One line per unusable registration: refused (a built-in name), ambiguous, or broken (it failed to import
        or is no :class:`Engine` class); the others are usable through :func:`engine_for`.
    """
    return REGISTRY.load_all()[1]


def engine_names() -> tuple[str, ...]:
    """The registered engines' names: the built-ins, then the plugins', each sorted by name."""
    return REGISTRY.names()


def engine_for(name: str) -> Engine:
    """The adapter registered as ``name``.

    Raises:
        DtbenchError: an unknown name (one line, with the closest registered names), a name two distributions
            register, or a plugin that could not be loaded (its problem).
    """
    cls = REGISTRY.get(name)
    if cls not in _ADAPTERS:
        _ADAPTERS[cls] = cls()
    return _ADAPTERS[cls]


def schedule_engines() -> tuple[str, ...]:
    """The registered engines that state a speculation schedule (:attr:`Engine.schedules`), in
    :func:`engine_names` order (an engine that fails to load is left out)."""
    out = []
    for name in engine_names():
        try:
            if engine_for(name).schedules:
                out.append(name)
        except DtbenchError:
            continue
    return tuple(out)
