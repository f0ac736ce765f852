"""Plugin discovery through entry-point groups, loaded lazily (pluggy-style): one :class:`Registry` class.

Built-in decoders register exactly as third-party ones do (group ``dtbench.decoders``). A plugin that fails to
import is reported with the distribution it came from and does not stop the other entries from loading.

Names shipped by dtbench itself are reserved: a third-party registration of a built-in name is *refused* (a
warning names its distribution; ``dtbench decoders`` lists it as refused), so no plugin can silently replace the
``ar`` baseline. Two third-party distributions claiming one name make that name *ambiguous*: using it is a
one-line error naming both.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar, cast

from pydantic import BaseModel, ValidationError

from dtbench.decoders.base import FAMILIES, Decoder, DecoderParams
from dtbench.harness.errors import DtbenchError, error_location

T = TypeVar("T")  # the base class a registry's plugins subclass (its ``base``; abstract, so not typed type[T])

DECODER_GROUP = "dtbench.decoders"  # the entry-point group decoders register under
BUILTIN_DISTRIBUTION = "dtbench"


@dataclass(frozen=True)
class DecoderEntry:
    """One registered plugin: its name, the distribution that registered it and its entry point."""

    name: str
    distribution: str
    version: str
    entry_point: Any  # importlib.metadata.EntryPoint (or anything with .load())

    def load(self) -> type[Decoder]:
        """Import the registered object.

        Raises:
            DtbenchError: naming the distribution, if the import fails or the object has the wrong base class.
        """
        return cast("type[Decoder]", _load(self, Decoder, "decoder"))  # checked to subclass Decoder


@cache
def _load(entry: DecoderEntry, base: type, kind: str) -> type:
    try:
        obj = entry.entry_point.load()
    except (Exception, SystemExit) as exc:  # any import-time failure of a plugin is the plugin's, reported by name
        raise DtbenchError(
            f"{kind} '{entry.name}' from distribution {entry.distribution} {entry.version} failed to load: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise DtbenchError(
            f"{kind} '{entry.name}' from distribution {entry.distribution} is {obj!r}, not a dtbench {base.__name__} "
            f"subclass"
        )
    return obj


@dataclass
class Discovery:
    """What one scan of an entry-point group found.

    Attributes:
        entries: usable registrations by name.
        refused: third-party registrations of a built-in name (never used).
        ambiguous: names claimed by two or more third-party distributions (unusable until one is uninstalled).
    """

    entries: dict[str, DecoderEntry] = field(default_factory=dict)
    refused: list[DecoderEntry] = field(default_factory=list)
    ambiguous: dict[str, list[DecoderEntry]] = field(default_factory=dict)

    def warnings(self, kind: str) -> list[str]:
        """One line per refused or ambiguous registration."""
        out = [
            f"{kind} '{e.name}' from distribution {e.distribution} {e.version} refused: '{e.name}' is a "
            f"built-in name of dtbench"
            for e in self.refused
        ]
        out += [
            f"{kind} '{name}' is registered by {_both(es)}; uninstall one to use it"
            for name, es in self.ambiguous.items()
        ]
        return out


def _both(entries: list[DecoderEntry]) -> str:
    return " and ".join(f"{e.distribution} {e.version}" for e in entries)


class Registry(Generic[T]):
    """Lazy entry-point registry of one kind of plugin (decoders, datasets).

    Args:
        group: the entry-point group, e.g. ``dtbench.decoders``.
        kind: the word used in messages ("decoder", "dataset").
        base: the class every registered object must subclass.
    """

    def __init__(self, group: str, kind: str, base: type):
        self.group, self.kind, self.base = group, kind, base

    def scan(self) -> Discovery:
        """Read the entry-point group (nothing imported). ``DTBENCH_DISABLE_PLUGINS=1`` keeps built-ins only."""
        only_builtin = os.environ.get("DTBENCH_DISABLE_PLUGINS", "") not in ("", "0")
        builtin: dict[str, DecoderEntry] = {}
        third: dict[str, list[DecoderEntry]] = {}
        for ep in entry_points(group=self.group):
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            entry = DecoderEntry(ep.name, dist, version, ep)
            if dist == BUILTIN_DISTRIBUTION:
                builtin.setdefault(ep.name, entry)
            elif not only_builtin:
                same = third.setdefault(ep.name, [])
                if all(e.distribution != dist for e in same):  # one distribution seen twice (two paths) is one
                    same.append(entry)
        found = Discovery(entries=dict(builtin))
        for name, entries in third.items():
            if name in builtin:
                found.refused.extend(entries)
            elif len(entries) > 1:
                found.ambiguous[name] = sorted(entries, key=lambda e: e.distribution)
            else:
                found.entries[name] = entries[0]
        return found

    def get(self, name: str, found: Discovery | None = None) -> type[T]:
        """The class registered as ``name``.

        Raises:
            DtbenchError: for an unknown name (with the closest registered names), an ambiguous name (naming
                both distributions) or a broken plugin.
        """
        found = found or self.scan()
        if name in found.ambiguous:
            raise DtbenchError(
                f"{self.kind} '{name}' is registered by {_both(found.ambiguous[name])}; uninstall one of them to use it"
            )
        if name not in found.entries:
            close = difflib.get_close_matches(name, found.entries, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise DtbenchError(f"unknown {self.kind} '{name}'{hint} (registered: {', '.join(sorted(found.entries))})")
        return cast("type[T]", _load(found.entries[name], self.base, self.kind))  # a subclass of self.base


DECODERS: Registry[Decoder] = Registry(DECODER_GROUP, "decoder", Decoder)


def scan() -> Discovery:
    """The decoders' full discovery (usable, refused and ambiguous registrations)."""
    return DECODERS.scan()


def discover() -> dict[str, DecoderEntry]:
    """Usable registered decoders by name (nothing imported yet); see :class:`Registry`."""
    return DECODERS.scan().entries


def get(name: str) -> type[Decoder]:
    """The decoder class registered as ``name``.

    Raises:
        DtbenchError: for an unknown or ambiguous name (with the closest registered names), a broken plugin, or a
            decoder declaring a family that is not one of :data:`~dtbench.decoders.base.FAMILIES`.
    """
    found = DECODERS.scan()
    found.entries = discover()  # module-level discover() may be patched (tests inject fake entries)
    cls = DECODERS.get(name, found)
    if cls.family not in FAMILIES:
        raise DtbenchError(
            f"decoder '{name}' declares family {cls.family!r}; a decoder's family is one of {', '.join(FAMILIES)}"
        )
    return cls


def validate_params(name: str, params: dict[str, Any]) -> DecoderParams:
    """Validate a suite's ``params:`` against the decoder's own params model (:func:`validate_model`).

    Raises:
        DtbenchError: one line naming the decoder, the field and the problem.
    """
    return validate_model("decoder", name, get(name).Params, params)


def validate_model(kind: str, name: str, model: type[BaseModel], params: dict[str, Any]) -> Any:
    """Validate a suite entry's ``params:`` against a plugin's own pydantic ``Params`` model: the one code path for
    decoders' and datasets' params (:data:`dtbench.decoders.base.DecoderParams`,
    :class:`dtbench.harness.data.DatasetParams`).

    Args:
        kind: the plugin kind in messages ("decoder", "dataset").
        name: the registered name.
        model: the plugin's ``Params`` class.
        params: the suite's ``params:`` mapping.

    Returns:
        An instance of ``model``.

    Raises:
        DtbenchError: one line naming the plugin, the field and the problem, with the known parameters.
    """
    try:
        return model.model_validate(params)
    except ValidationError as exc:
        loc, msg = error_location(exc)
        msg = "unknown parameter" if exc.errors()[0]["type"] == "extra_forbidden" else msg
        loc = loc or "params"
        known = ", ".join(model.model_fields) or "none"
        raise DtbenchError(f"{kind} '{name}': params.{loc}: {msg} (parameters: {known})") from None
