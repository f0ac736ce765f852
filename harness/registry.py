"""Decoder discovery through the ``dtbench.decoders`` entry-point group, loaded lazily (pluggy-style).

Built-in decoders register exactly as third-party ones do. A plugin that fails to import is reported with
the distribution it came from and does not stop the other decoders from loading.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from pydantic import ValidationError

from dtbench.decoders.base import Decoder, DecoderParams
from dtbench.harness.errors import DtbenchError

GROUP = "dtbench.decoders"


@dataclass(frozen=True)
class DecoderEntry:
    """One registered decoder: its name, the distribution that registered it and its entry point."""

    name: str
    distribution: str
    version: str
    entry_point: EntryPoint

    def load(self) -> type[Decoder]:
        """Import the decoder class.

        Raises:
            DtbenchError: naming the distribution, if the import fails or the object is not a Decoder subclass.
        """
        return _load(self)


@lru_cache(maxsize=None)
def _load(entry: DecoderEntry) -> type[Decoder]:
    try:
        obj = entry.entry_point.load()
    except Exception as exc:  # any import-time failure of a plugin is the plugin's, reported by name
        raise DtbenchError(
            f"decoder '{entry.name}' from distribution {entry.distribution} {entry.version} failed to load: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if not (isinstance(obj, type) and issubclass(obj, Decoder)):
        raise DtbenchError(
            f"decoder '{entry.name}' from distribution {entry.distribution} is {obj!r}, not a dtbench Decoder subclass"
        )
    return obj


def discover() -> dict[str, DecoderEntry]:
    """All registered decoders by name (nothing imported yet).

    Set ``DTBENCH_DISABLE_PLUGINS=1`` to keep only decoders shipped by dtbench itself.
    """
    only_builtin = os.environ.get("DTBENCH_DISABLE_PLUGINS", "") not in ("", "0")
    found: dict[str, DecoderEntry] = {}
    for ep in entry_points(group=GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        if only_builtin and dist != "dtbench":
            continue
        version = ep.dist.version if ep.dist is not None else "?"
        # The first registration of a name wins; a later duplicate from another distribution is ignored.
        found.setdefault(ep.name, DecoderEntry(ep.name, dist, version, ep))
    return found


def get(name: str) -> type[Decoder]:
    """The decoder class registered as ``name``.

    Raises:
        DtbenchError: for an unknown name (with the closest registered names) or a broken plugin.
    """
    entries = discover()
    if name not in entries:
        close = difflib.get_close_matches(name, entries, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise DtbenchError(f"unknown decoder '{name}'{hint} (registered: {', '.join(sorted(entries))})")
    return entries[name].load()


def validate_params(name: str, params: dict[str, Any]) -> DecoderParams:
    """Validate a suite's ``params:`` against the decoder's own params model.

    Raises:
        DtbenchError: one line naming the decoder, the field and the problem.
    """
    cls = get(name)
    try:
        return cls.Params.model_validate(params)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "params"
        msg = "unknown parameter" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        known = ", ".join(cls.Params.model_fields) or "none"
        raise DtbenchError(f"decoder '{name}': params.{field}: {msg} (parameters: {known})") from None
