"""The one plugin registry (issue 49 item 3): every kind of plugin is found through an entry-point group by one
:class:`Registry` class, with one policy. Torch-free, so every layer may use it (decoders, datasets, report formats,
serving engines, executors).

The policy:

- Built-ins are declared only as entry points in dtbench's own ``pyproject.toml``, exactly as a plugin's are; an
  entry of the distribution ``dtbench`` is built in.
- Scanning a group reads installed distributions' metadata and imports nothing; an entry is imported at its first
  :meth:`Registry.get` (and once: the loaded object is kept).
- A third-party registration of a built-in name is *refused* (never used; reported with its distribution). Two
  third-party distributions claiming one name make it *ambiguous*: using it is a one-line error naming both.
- ``DTBENCH_DISABLE_PLUGINS=1`` keeps the built-ins only, in every registry.
- The loaded object is type-checked at :meth:`Registry.get` (a subclass, an instance or a callable of what the
  registry expects: its :class:`Expect`); a plugin that fails to import, or loads the wrong thing, is a one-line
  :class:`~dtbench.core.DtbenchError` naming its distribution.
- A plugin's import runs under a time limit (issue 59 item 3): ``DTBENCH_PLUGIN_IMPORT_TIMEOUT`` seconds
  (:data:`DEFAULT_IMPORT_TIMEOUT_S` by default; ``inf``: no limit). The import is tried first in a child process
  forked from the kit's fork server (issue 67 item 5: :mod:`dtbench.harness.execution.plugin_probe`, the
  :class:`ImportGuard` the harness installs at its import with :func:`guard_imports`; this module imports nothing
  above :mod:`dtbench.core`, issue 68 item 5, so without a guard a plugin is imported as it is); one that has not finished
  within the limit is killed with its process and is a broken plugin ("did not finish importing within N s"), a
  problem line in ``dtbench plugins`` and a warning elsewhere, never a hang and never an import left running beside a
  measurement (before, a daemon thread the caller could not stop kept a core busy). An import that raises, exits or
  crashes in the child is reported the same way, by name; one that finished is imported in the caller without a
  limit (the loaded object must live in this process). Built-ins (dtbench's own entry points, trusted, and the first
  to import torch) load on the caller's thread without a limit.
- A group is scanned once per process (issue 58 item 6: a run scanned the entry points 35 times for two cells): the
  scan is kept while ``sys.path``, its folders' modification times and ``DTBENCH_DISABLE_PLUGINS`` stay as they were
  (a distribution put on the path or ``pip install``-ed into a folder on it is seen at the next
  :meth:`Registry.scan`); :meth:`Registry.refresh` reads the group again.
- Code in this process registers an object with :meth:`Registry.register` (the report formats' ``@renderer``): it is
  an entry of the one registry like an entry point's, distribution ``in-process``, listed by ``dtbench plugins``;
  a built-in name is refused, a name a plugin also claims is ambiguous. ``DTBENCH_DISABLE_PLUGINS`` does not hide it
  (it keeps installed distributions out, and this is no installed distribution).
"""

from __future__ import annotations

import difflib
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar, cast

from dtbench.core import DtbenchError, clip

T = TypeVar("T")  # what a registry's get returns: a class (type[Decoder]) or a function (a renderer)

BUILTIN_DISTRIBUTION = "dtbench"
IN_PROCESS = "in-process"  # the distribution of an object registered with Registry.register (issue 58 item 6)
DISABLE_ENV = "DTBENCH_DISABLE_PLUGINS"
IMPORT_TIMEOUT_ENV = "DTBENCH_PLUGIN_IMPORT_TIMEOUT"
DEFAULT_IMPORT_TIMEOUT_S = 10.0  # seconds a plugin's module may take to import (a plugin importing torch: ~2-5 s)


def path_state() -> tuple[tuple[str, int], ...]:
    """``sys.path`` with each folder's modification time in ns (-1 where it is not a folder): installing or removing a
    distribution adds or drops a ``*.dist-info`` folder in one of them, so a kept entry-point scan is read again
    (:meth:`Registry.scan`). One ``stat`` per entry (~20 us each)."""
    state = []
    for entry in sys.path:
        try:
            mtime = os.stat(entry or ".").st_mtime_ns
        except OSError:
            mtime = -1
        state.append((entry, mtime))
    return tuple(state)


def plugins_disabled() -> bool:
    """Whether ``DTBENCH_DISABLE_PLUGINS`` is set (to anything but "" or "0"): only built-ins are registered."""
    return os.environ.get(DISABLE_ENV, "") not in ("", "0")


def import_timeout_s() -> float:
    """Seconds a plugin's import may take: ``DTBENCH_PLUGIN_IMPORT_TIMEOUT``, else :data:`DEFAULT_IMPORT_TIMEOUT_S`
    (issue 59 item 3).

    ``inf`` means no limit (the import is waited for however long it takes).

    Raises:
        DtbenchError: the variable is set to something other than a number of seconds > 0 or ``inf`` (the command
            stops with that one line, exit 2: issue 67; before, every plugin read as "failed to load" and exit 0).
    """
    raw = os.environ.get(IMPORT_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_IMPORT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value <= 0:
        raise DtbenchError(f"{IMPORT_TIMEOUT_ENV}={clip(raw, 40)!r} is not a number of seconds > 0 (or inf: no limit)")
    return value


_PROBED: dict[tuple[Any, ...], str | None] = {}  # (name, value, group, sys.path) -> None (its import ends) or why not


@dataclass(frozen=True)
class ImportGuard:
    """How a plugin's import is bounded, installed by the layer that can start processes (:func:`guard_imports`;
    the harness's :func:`dtbench.harness.execution.plugin_probe.install`), so that the registry imports nothing above
    the core (issue 68 item 5: it imported the harness's probe and the plugin API by name, the one import pointing up).

    Attributes:
        probe: ``probe(name, value, group, timeout_s)`` tries the entry point's import where it can be stopped;
            returns when it ends (or where nothing could be tried), raises :class:`PluginImportFailed` saying why not.
        preload: imports what every plugin imports (the plugin API: torch, transformers) without a limit, before
            the plugin's own import is timed.
    """

    probe: Callable[[str, str, str, float], None]
    preload: Callable[[], None]


_GUARD: list[ImportGuard] = []  # the installed guard, if any (a list: set once, read at every bounded load)


def guard_imports(guard: ImportGuard) -> None:
    """Install ``guard`` for every registry of this process (the last one installed is used)."""
    _GUARD[:] = [guard]


def load_bounded(entry_point: Any, timeout_s: float) -> Any:
    """``entry_point.load()`` once a child process showed, within ``timeout_s`` seconds, that the import ends (issue 67
    item 5: the installed :class:`ImportGuard`'s probe); nothing is left importing beside the caller. The child's
    verdict is kept for the process: an entry is tried once. Where no child can start (a ``__main__`` read from
    standard input), or where no guard is installed, the entry is imported without a limit. An object without
    ``value`` and ``group`` (a test's stand-in with ``load()`` only) has no module to try and is loaded as it is.

    Raises:
        PluginImportFailed: the import did not finish within the limit, raised or ended its process (the message says
            which); nothing of it was imported here.
    """
    value, group, name = (getattr(entry_point, attr, None) for attr in ("value", "group", "name"))
    if not (isinstance(value, str) and isinstance(group, str)) or not _GUARD:
        return entry_point.load()
    key = (str(name), value, group, tuple(sys.path))
    if key not in _PROBED:
        try:
            _GUARD[0].probe(str(name), value, group, timeout_s)
            _PROBED[key] = None
        except PluginImportFailed as exc:
            _PROBED[key] = str(exc)
    if _PROBED[key] is not None:
        raise PluginImportFailed(_PROBED[key])
    return entry_point.load()


class PluginImportFailed(Exception):
    """A plugin's import that did not finish within its time limit, raised or ended its process, in the child
    process that tried it (:func:`load_bounded`); ``str()`` follows "from distribution X 1.0"."""


@dataclass(frozen=True)
class Entry:
    """One registration: its name, the distribution that registered it and its entry point.

    Attributes:
        entry_point: an :class:`importlib.metadata.EntryPoint`, or anything with ``.load()`` (tests' fakes).
    """

    name: str
    distribution: str
    version: str
    entry_point: Any

    @property
    def builtin(self) -> bool:
        """Whether dtbench itself registered it."""
        return self.distribution == BUILTIN_DISTRIBUTION

    @property
    def in_process(self) -> bool:
        """Whether code in this process registered it (:meth:`Registry.register`; its version is its module)."""
        return self.distribution == IN_PROCESS

    @property
    def label(self) -> str:
        """``distribution version``, as messages name it."""
        return f"{self.distribution} {self.version}"


@dataclass(frozen=True, eq=False)
class Registered:
    """The entry point of an object registered in-process (:meth:`Registry.register`): ``load()`` returns it."""

    obj: Any

    def load(self) -> Any:
        """The registered object."""
        return self.obj


@dataclass(frozen=True)
class Expect:
    """What a registry's entries must load to: ``accepts(obj)`` is the check, ``what`` its words in an error.

    Use :func:`subclass_of`, :func:`instance_of` or :func:`a_callable` to build one.
    """

    accepts: Callable[[object], bool]
    what: str


def subclass_of(base: type) -> Expect:
    """Entries load to a subclass of ``base`` (decoders, datasets, engines, executors)."""
    return Expect(lambda obj: isinstance(obj, type) and issubclass(obj, base), f"a subclass of {base.__name__}")


def instance_of(base: type) -> Expect:
    """Entries load to an instance of ``base``."""
    return Expect(lambda obj: isinstance(obj, base), f"an instance of {base.__name__}")


def a_callable(what: str) -> Expect:
    """Entries load to a callable that is not a class (report formats' renderer functions); ``what`` names it."""
    return Expect(lambda obj: callable(obj) and not isinstance(obj, type), what)


@dataclass
class Discovery:
    """What one scan of an entry-point group found.

    Attributes:
        entries: usable registrations by name (built-ins first, then plugins', each sorted by name).
        refused: third-party registrations of a built-in name (never used).
        ambiguous: names claimed by two or more third-party distributions (unusable until one is uninstalled).
    """

    entries: dict[str, Entry] = field(default_factory=dict)
    refused: list[Entry] = field(default_factory=list)
    ambiguous: dict[str, list[Entry]] = field(default_factory=dict)

    def warnings(self, kind: str) -> list[str]:
        """One line per refused or ambiguous registration."""
        out = [refused_line(kind, e) for e in self.refused]
        out += [ambiguous_line(kind, name, es) for name, es in self.ambiguous.items()]
        return out


def refused_line(kind: str, entry: Entry) -> str:
    """The one line reporting a third-party registration of a built-in name."""
    return (
        f"{kind} '{clip(entry.name, 80)}' from distribution {entry.label} refused: '{clip(entry.name, 80)}' is a "
        f"built-in name of dtbench"
    )


def ambiguous_line(kind: str, name: str, entries: list[Entry]) -> str:
    """The one line reporting a name several third-party distributions register."""
    return f"{kind} '{clip(name, 80)}' is registered by {_both(entries)}; uninstall one of them to use it"


def _both(entries: list[Entry]) -> str:
    return " and ".join(e.label for e in entries)


class Registry(Generic[T]):
    """Lazy entry-point registry of one kind of plugin (see the module docstring for the policy).

    Args:
        group: the entry-point group, e.g. ``dtbench.decoders``.
        kind: the word used in messages ("decoder", "dataset", "report format", "engine", "executor").
        expect: what every registered object must load to (:func:`subclass_of`, :func:`a_callable`, ...).
    """

    def __init__(self, group: str, kind: str, expect: Expect):
        self.group, self.kind, self.expect = group, kind, expect
        self._loaded: dict[Entry, T] = {}
        self._local: dict[str, Entry] = {}  # registered in this process (register), by name
        self._scanned: tuple[object, Discovery] | None = None  # (sys.path and the disable flag, their scan)
        self.reads = 0  # times the entry-point group was read in this process (tests count them)

    def __repr__(self) -> str:
        return f"Registry({self.group!r})"

    def scan(self) -> Discovery:
        """The group's registrations (nothing imported): the entry points, read once per process while ``sys.path``,
        its folders' modification times (:func:`path_state`: a ``pip install`` since the last read changes them) and
        ``DTBENCH_DISABLE_PLUGINS`` stay the same (``=1`` keeps built-ins only), then this process's own
        (:meth:`register`). A new :class:`Discovery` each call: the caller may edit it."""
        key = (path_state(), plugins_disabled())
        if self._scanned is None or self._scanned[0] != key:
            self._scanned = (key, self._read())
        base = self._scanned[1]
        found = Discovery(dict(base.entries), list(base.refused), {n: list(es) for n, es in base.ambiguous.items()})
        for name, entry in self._local.items():
            if name in found.ambiguous:
                found.ambiguous[name].append(entry)
            elif name in found.entries:  # a plugin's name (a built-in's is refused by register)
                found.ambiguous[name] = [found.entries.pop(name), entry]
            else:
                found.entries[name] = entry
        return found

    def refresh(self) -> None:
        """Forget the kept scan: the next :meth:`scan` reads the entry-point group again (a distribution installed
        into a folder already on ``sys.path`` since the last scan)."""
        self._scanned = None

    def register(self, name: str, obj: T) -> T:
        """Register ``obj`` under ``name`` from this process (issue 58 item 6): an entry of this registry like an
        entry point's (distribution ``in-process``, version its module), so :meth:`get`, :meth:`load_all` and
        ``dtbench plugins`` see it. Registering a name again replaces this process's earlier registration.

        Returns:
            ``obj`` (so a decorator can return the function it registers).

        Raises:
            DtbenchError: ``name`` is a built-in's (never taken over), or ``obj`` is not what the registry expects.
        """
        builtin = self.scan().entries.get(name)
        if builtin is not None and builtin.builtin:
            raise DtbenchError(
                f"{self.kind} '{clip(name, 80)}' is a built-in name of dtbench and cannot be registered again"
            )
        if not self.expect.accepts(obj):
            raise DtbenchError(f"{self.kind} '{clip(name, 80)}' is {clip(repr(obj), 80)}, not {self.expect.what}")
        module = getattr(obj, "__module__", None) or "?"
        self._local[name] = Entry(name, IN_PROCESS, str(module), Registered(obj))
        return obj

    def unregister(self, name: str) -> None:
        """Drop this process's registration of ``name`` (:meth:`register`); nothing if there is none."""
        self._local.pop(name, None)

    def _read(self) -> Discovery:
        """Read the entry-point group: built-ins, and the others refused, ambiguous or usable."""
        self.reads += 1
        only_builtin = plugins_disabled()
        builtin: dict[str, Entry] = {}
        third: dict[str, list[Entry]] = {}
        for ep in entry_points(group=self.group):
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            entry = Entry(ep.name, dist, version, ep)
            if entry.builtin:
                builtin.setdefault(ep.name, entry)
            elif not only_builtin:
                same = third.setdefault(ep.name, [])
                if all(e.distribution != dist for e in same):  # one distribution seen twice (two paths) is one
                    same.append(entry)
        found = Discovery(entries={name: builtin[name] for name in sorted(builtin)})  # not the installer's order
        for name in sorted(third):
            entries = third[name]
            if name in builtin:
                found.refused.extend(entries)
            elif len(entries) > 1:
                found.ambiguous[name] = sorted(entries, key=lambda e: e.distribution)
            else:
                found.entries[name] = entries[0]
        return found

    def names(self, found: Discovery | None = None) -> tuple[str, ...]:
        """The usable names: built-ins first, then plugins', each sorted by name."""
        return tuple((found or self.scan()).entries)

    def load(self, entry: Entry) -> T:
        """Import one registration and check what it loads to (kept after the first success).

        Raises:
            DtbenchError: naming the distribution, if the import fails, does not finish within
                :func:`import_timeout_s` (a plugin; issue 59 item 3), or the object is not what the registry expects.
        """
        if entry in self._loaded:
            return self._loaded[entry]
        what = f"{self.kind} '{clip(entry.name, 80)}' from distribution {entry.label}"
        trusted = entry.builtin or entry.in_process  # imported already, or dtbench's own: no time limit
        limit = None if trusted else import_timeout_s()  # a bad setting is the user's one-line error, not the plugin's
        try:
            if not trusted and _GUARD:  # the plugin API every plugin imports (torch, transformers: seconds on a
                # busy machine) is dtbench's own and imported without a limit first: the limit times the plugin's own
                _GUARD[0].preload()
            obj = entry.entry_point.load() if limit is None else load_bounded(entry.entry_point, limit)
        except PluginImportFailed as exc:
            raise DtbenchError(f"{what} {exc}") from None
        except (Exception, SystemExit) as exc:  # any import-time failure of a plugin is the plugin's, reported by name
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise DtbenchError(f"{what} failed to load: {type(exc).__name__}: {clip(first, 200)}") from None
        if not self.expect.accepts(obj):
            raise DtbenchError(f"{what} is {clip(repr(obj), 80)}, not {self.expect.what}")
        self._loaded[entry] = cast("T", obj)  # checked by self.expect
        return self._loaded[entry]

    def get(self, name: str, found: Discovery | None = None) -> T:
        """The object registered as ``name``, loaded and type-checked.

        Raises:
            DtbenchError: for an unknown name (with the closest registered names), an ambiguous name (naming both
                distributions) or a broken plugin.
        """
        found = found or self.scan()
        if name in found.ambiguous:
            raise DtbenchError(ambiguous_line(self.kind, name, found.ambiguous[name]))
        if name not in found.entries:
            close = difflib.get_close_matches(name, found.entries, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise DtbenchError(f"unknown {self.kind} '{clip(name, 80)}'{hint} (registered: {', '.join(found.entries)})")
        return self.load(found.entries[name])

    def load_all(self, found: Discovery | None = None) -> tuple[dict[str, T], list[str]]:
        """Every usable entry loaded: (object by name, one line per problem: refused, ambiguous or broken)."""
        found = found or self.scan()
        loaded: dict[str, T] = {}
        problems = found.warnings(self.kind)
        for name, entry in found.entries.items():
            try:
                loaded[name] = self.load(entry)
            except DtbenchError as exc:
                problems.append(str(exc))
        return loaded, problems
