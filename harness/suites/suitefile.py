"""Suite files: YAML (``include:``) -> the validated suite of :mod:`dtbench.harness.suites.suite`, errors at file:line.

The loader reads a suite file and the files it includes, merges them (the including file's top-level keys last),
validates the result with the pydantic schema and turns a validation error into one line naming the file, the
line and the field. ``prompt_cap``, the deprecated old name of ``L_max``, gets a note on stderr (the schema accepts
it). The text it returns (the file's own, then every included file's) is what a run stores and hashes.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dtbench.core import redact_yaml
from dtbench.harness.errors import DtbenchError, clip, error_location
from dtbench.harness.safetext import printable
from dtbench.harness.suites.bounds import MAX_SUITE_BYTES, read_regular_file
from dtbench.harness.suites.suite import Suite
from dtbench.harness.suites.suitebase import L_MAX, OLD_L_MAX

MAX_NODES = 100_000  # YAML values after alias expansion: a suite is a page of text, not a billion laughs
MAX_DEPTH = 64  # nesting levels of a suite's YAML (a real one has about 5)


def _count_nodes(data: Any, limit: int) -> tuple[int, int]:
    """(values, deepest nesting) of ``data``, counted as if YAML aliases were copied, stopping as soon as ``limit``
    values are passed."""
    count, deepest, stack = 0, 0, [(data, 1)]
    while stack:
        item, depth = stack.pop()
        count += 1
        deepest = max(deepest, depth)
        if count > limit:
            return count, deepest
        if isinstance(item, dict):
            stack.extend((k, depth + 1) for k in item.keys())
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return count, deepest


def _line_of(node: yaml.Node | None, loc: tuple) -> int | None:
    """The 1-based line of the YAML node at pydantic location ``loc``, as deep as the document goes."""
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            match = [v for k, v in node.value if k.value == key]
            if not match:
                break
            node = match[0]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            break
        line = node.start_mark.line + 1
    return line


MAX_INCLUDE_DEPTH = 8


def _compose(text: str, source: str) -> tuple[dict, yaml.Node]:
    """(data, node) of one YAML document that must be a mapping.

    Raises:
        DtbenchError: malformed YAML, not a mapping, or more than MAX_NODES values after alias expansion.
    """
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except RecursionError:  # PyYAML composes nested collections recursively
        raise DtbenchError(f"{source}: the YAML nests more than {MAX_DEPTH} levels deep") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise DtbenchError(f"{where}: malformed YAML: {clip(problem)}") from None
    if not isinstance(data, dict):
        raise DtbenchError(f"{source}: a suite must be a YAML mapping (name:, datasets:, decoders:, ...)")
    count, depth = _count_nodes(data, MAX_NODES)
    if count > MAX_NODES:
        raise DtbenchError(
            f"{source}: the suite expands to more than {MAX_NODES} values (YAML aliases nested too "
            f"deeply?); write the values out"
        )
    if depth > MAX_DEPTH:
        raise DtbenchError(f"{source}: the YAML nests more than {MAX_DEPTH} levels deep")
    return data, node


def _note_old_names(data: dict, where_of) -> None:
    """One line on stderr when datasets or decoders entries use ``prompt_cap:`` (the old name of ``L_max:``)."""
    old = [
        (key, i, L_MAX in entry)
        for key in ("datasets", "decoders")
        if isinstance(data.get(key), list)
        for i, entry in enumerate(data[key])
        if isinstance(entry, dict) and OLD_L_MAX in entry
    ]
    if old and not any(both for *_, both in old):  # both keys in one entry: the validation error says it all
        key, i, _ = old[0]
        more = f" (and {len(old) - 1} more entries)" if len(old) > 1 else ""
        where = printable(where_of((key, i, OLD_L_MAX)))
        print(
            f"note: {where}: {key}.{i}: {OLD_L_MAX} is the deprecated name of {L_MAX}{more}; write {L_MAX}",
            file=sys.stderr,
            flush=True,
        )


def _validate(data: dict, where_of) -> Suite:
    """Validate merged suite data; ``where_of(loc)`` gives ``file:line`` of a pydantic location."""
    _note_old_names(data, where_of)
    try:
        suite = Suite.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field, msg = error_location(exc)
        loc = tuple(int(p) if p.isdigit() else p for p in field.split(".")) if field else ()
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise DtbenchError(f"{where_of(loc)}: {clip(field, 100) or 'suite'}: {msg}{more}") from None
    for i, spec in enumerate(suite.decoders):
        spec.locate(f"{where_of(('decoders', i))}: decoders.{i}")
    for i, ds in enumerate(suite.datasets):
        ds.locate(f"{where_of(('datasets', i))}: datasets.{i}")
    return suite


def parse_suite(text: str, source: str = "<suite>") -> Suite:
    """Parse and validate suite YAML (without ``include:``; :func:`load_suite` resolves includes).

    Args:
        text: the YAML document.
        source: the file name used in error messages.

    Raises:
        DtbenchError: one line naming the file, line and field for malformed YAML, unknown keys or bad values.
    """
    data, node = _compose(text, source)
    if "include" in data:
        raise DtbenchError(f"{source}: include: needs a suite file (load it with load_suite)")
    return _validate(data, lambda loc: f"{source}:{_line_of(node, loc)}")


def _read(path: Path, budget: int = MAX_SUITE_BYTES) -> str:
    """The text of a suite file: a regular file (not a device, pipe or folder) of at most ``budget`` bytes, UTF-8.

    Raises:
        DtbenchError: unreadable, not a regular file, larger than ``budget``, or not UTF-8.
    """
    raw = read_regular_file(path, budget, what="suite")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DtbenchError(f"{path}:{line}: not UTF-8 text (byte {exc.start}); save the suite as UTF-8") from None


def _load_tree(path: Path, chain: tuple[Path, ...], texts: list[tuple[Path, str]]) -> tuple[dict, dict]:
    """Merged data of ``path`` and its includes, and for each top-level key the (file, node) that set it.

    ``include:`` names one file or a list, relative to the including file; they are merged in order, then the
    including file's own keys override theirs (top-level keys are replaced whole, lm-evaluation-harness style).
    A file is read and merged once, where it is first included (a second include of it adds nothing), so files
    that include each other several times cannot fan out into 10^n loads; all files together hold at most
    MAX_SUITE_BYTES.
    """
    if len(chain) > MAX_INCLUDE_DEPTH:
        raise DtbenchError(f"{path}: include: nested more than {MAX_INCLUDE_DEPTH} levels")
    used = sum(len(t.encode()) for _, t in texts)
    try:
        text = _read(path, MAX_SUITE_BYTES - used)
    except DtbenchError as exc:
        if texts and "larger than" in str(exc):
            raise DtbenchError(
                f"{path}: the suite and its include: files hold more than {MAX_SUITE_BYTES:,} bytes together"
            ) from None
        raise
    texts.append((path, text))
    data, node = _compose(text, str(path))
    merged: dict = {}
    origin: dict = {}
    includes = data.pop("include", None)
    if includes is not None:
        names = includes if isinstance(includes, list) else [includes]
        for name in names:
            if not isinstance(name, str) or not name:
                raise DtbenchError(
                    f"{path}:{_line_of(node, ('include',))}: include: must be a file name or a list of them"
                )
            child = (path.parent / name).resolve()
            if child in chain or child == path.resolve():
                raise DtbenchError(f"{path}: include: {clip(name, 100)} includes itself (directly or not)")
            if not child.exists():
                raise DtbenchError(f"{path}:{_line_of(node, ('include',))}: include: {clip(name, 100)} not found")
            if any(p.resolve() == child for p, _ in texts):
                continue  # already merged where it was first included
            sub, sub_origin = _load_tree(child, chain + (path.resolve(),), texts)
            merged.update(sub)
            origin.update(sub_origin)
    merged.update(data)
    origin.update({k: (path, node) for k in data})
    return merged, origin


def load_suite(path: str | Path) -> tuple[Suite, str]:
    """Read and validate a suite file, resolving ``include:`` (files merged in order, this file's keys last).

    Returns:
        (suite, its text): the text stored with the run (and hashed to match a resumed run) is the file's own
        text followed by every included file's, so changing an included file makes a new suite.

    Raises:
        DtbenchError: if a file is missing or invalid, an include cycles or nests too deeply.
    """
    path = Path(path)
    texts: list[tuple[Path, str]] = []
    data, origin = _load_tree(path, (), texts)

    def where_of(loc: tuple) -> str:
        src, node = origin.get(loc[0], (path, None)) if loc else (path, None)
        if node is None:
            return str(src)
        return f"{src}:{_line_of(node, loc)}"

    suite = _validate(data, where_of)
    text = texts[0][1] + "".join(f"\n# --- include: {p} ---\n{t}" for p, t in texts[1:])
    return suite, text


def suite_hash(text: str) -> str:
    """sha256 (hex) of the suite text as stored with each run: its URL credentials masked
    (:func:`dtbench.core.redact_yaml`; the run stores that text, and a hash of the unmasked text would let
    anyone holding the database test password guesses against it). A suite without credentials hashes as before;
    a resumed run may use another password for the same server."""
    return hashlib.sha256(redact_yaml(text).encode()).hexdigest()
