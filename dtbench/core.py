"""What every layer of dtbench shares, without torch: the user-facing error, strict pydantic types and the corpus
declaration a decoder's params may hold.

Importing this module imports pydantic only, so the suite schema and loader (:mod:`dtbench.harness.suite`,
:mod:`dtbench.harness.suitefile`), which build on it, load without torch (tests/test_import_graph.py checks it).
The layers above: ``dtbench.decoders`` (torch), ``dtbench.harness``, ``dtbench.reports``, ``dtbench.cli``
(docs/architecture.md).
"""

from __future__ import annotations

import os
import re
import stat
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_ECHO = 200  # characters of a user's value echoed in an error message


class DtbenchError(Exception):
    """A user-facing error: bad suite, missing data, unknown model or decoder, unusable database.

    The message is one line that says what is wrong and, where possible, how to fix it; the CLI prints it and exits
    non-zero (never a traceback).
    """


# scheme://user:password@ (or scheme://token@): the userinfo of a URL anywhere in a text. The password runs to the
# last "@" before the end of the authority (users write unescaped "@" in passwords); quotes, brackets, whitespace,
# "/", "?" and "#" end it, so a URL inside JSON or a sentence is masked without eating the text after it.
_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^\s/?#@:\"'<>\\]*)(?P<pw>:[^\s/?#\"'<>\\]*)?@"
)


def _mask_userinfo(m: re.Match[str]) -> str:
    if m.group("pw") is None:  # a lone user part is often a token (https://TOKEN@host): masked whole
        return f"{m.group('scheme')}***@" if m.group("user") else m.group(0)
    return f"{m.group('scheme')}{m.group('user')}:***@"


def redact_credentials(value: Any) -> str:
    """``str(value)`` with the credentials of every URL in it masked: ``http://user:secret@host`` becomes
    ``http://user:***@host`` (the form SQLAlchemy's ``hide_password`` shows a database URL in), and a user part
    without a password (``https://TOKEN@host``, often a token) becomes ``***@``.

    The one rule for secrets in URLs (issue 42 item 1): every message (:func:`clip`), every printed or rendered text
    (``harness/safetext.printable``) and every value written to the database (:func:`redact_json`) goes through it.
    The request itself still uses the URL as given (the server needs the credentials)."""
    text = str(value)
    return _USERINFO.sub(_mask_userinfo, text) if "@" in text else text


def redact_json(value: Any) -> Any:
    """A JSON-like value (dicts, lists, strings, numbers) with :func:`redact_credentials` applied to every string,
    keys included; other values unchanged (a new container only where something changed is not promised)."""
    if isinstance(value, str):
        return redact_credentials(value)
    if isinstance(value, dict):
        return {redact_json(k) if isinstance(k, str) else k: redact_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_json(v) for v in value)
    return value


def clip(value: Any, limit: int = MAX_ECHO) -> str:
    """``str(value)`` on one line, its URL credentials masked (:func:`redact_credentials`, before the cut, so no part
    of a password survives it), cut to ``limit`` characters with an ellipsis (a suite can hold huge values)."""
    text = " ".join(redact_credentials(value).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --- bounded reads: a file a user names is read only if it is a regular file, and only so far -------------------


def read_regular_file(path: Path, limit: int, what: str) -> bytes:
    """The bytes of ``path``, refusing anything but a regular file and reading at most ``limit`` of them, so
    ``/dev/zero``, ``/dev/urandom``, a FIFO or a huge file is a one-line error instead of a hang or a MemoryError.

    Raises:
        DtbenchError: cannot be opened, not a regular file, or larger than ``limit`` bytes (naming ``what``).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # opening a FIFO must not wait for a writer
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise DtbenchError(f"{what} {path} is not a regular file (a device, pipe or folder)")
            raw = f.read(limit + 1)
    except OSError as exc:
        raise DtbenchError(f"cannot read {what} {path}: {exc.strerror}") from None
    if len(raw) > limit:
        raise DtbenchError(f"{what} {path} is larger than {limit:,} bytes (the limit for a {what} file)")
    return raw


# --- strict types: a boolean is never a number ---------------------------------------------------------------------


def admits_bool(annotation: Any) -> bool:
    """Whether a type annotation accepts a Python bool as such (``bool``, ``Any``, or a union holding one)."""
    if annotation is bool or annotation is Any or annotation is object:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return admits_bool(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return any(admits_bool(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return any(isinstance(a, bool) for a in typing.get_args(annotation))
    return False


def bool_misuse(annotation: Any, value: Any, path: str = "") -> str | None:
    """The path of the first bool in ``value`` where ``annotation`` wants a number or other non-bool, or None.

    Python's ``bool`` is an ``int`` subclass and pydantic's lax mode turns ``true`` into 1: in a benchmark
    suite ``k: true`` is a typo, never a chain length. Lists and dicts are checked element by element.
    """
    if isinstance(value, bool):
        return None if admits_bool(annotation) else path
    if admits_bool(annotation):
        return None
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return bool_misuse(args[0], value, path)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        problems = [bool_misuse(a, value, path) for a in options]
        return None if any(p is None for p in problems) else problems[0]
    if isinstance(value, list) and origin in (list, tuple, set, frozenset) and args:
        for i, item in enumerate(value):
            hit = bool_misuse(args[0], item, f"{path}.{i}" if path else str(i))
            if hit is not None:
                return hit
    if isinstance(value, dict) and origin is dict and len(args) == 2:
        for k, item in value.items():
            hit = bool_misuse(args[1], item, f"{path}.{k}" if path else str(k))
            if hit is not None:
                return hit
    return None


class StrictBools(BaseModel):
    """Mixin model that rejects ``true``/``false`` where a field wants a number (see :func:`bool_misuse`)."""

    @model_validator(mode="before")
    @classmethod
    def _no_bools_as_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, f in cls.model_fields.items():
                if name in data:
                    hit = bool_misuse(f.annotation, data[name], name)
                    if hit is not None:
                        raise ValueError(f"{hit}: a boolean is not a valid value here (booleans are not numbers)")
        return data


# --- the corpus declaration ----------------------------------------------------------------------------------------


class CorpusSpec(StrictBools):
    """A corpus a decoder retrieves from (REST's datastore, ``suffix``'s optional corpus): a dataset entry, as in a
    suite's ``datasets:`` (the dataset's name and where to read it), and ``skip``.

    The decoder only *declares* it: the harness loads the documents, tokenizes them with the decoder's tokenizer and
    hands them over (:meth:`dtbench.decoders.base.Decoder.use_corpus`), left out by the one prompt-selection rule
    (:func:`dtbench.harness.selection.held_out_documents`) with the suite's seed: the first ``skip`` usable documents of
    the seeded order (and every document before them) are never in the corpus, which are exactly the documents the
    suite's prompts of that dataset come from when ``prompts <= skip``. The plan refuses a corpus whose ``skip`` is
    smaller than the prompts of a suite entry of the same dataset (so no prompt's own text is ever retrieved).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: Annotated[str, Field(min_length=1, max_length=200)] = Field(description="a registered dataset's name")
    data_dir: str | None = Field(None, description="local data folder instead of the Hugging Face hub")
    path: str | None = Field(None, description="files for the text-files dataset (folder or glob)")
    hub_id: str | None = Field(None, description="Hugging Face dataset repo (or local folder of its parquet layout)")
    revision: str | None = Field(None, description="hub revision to pin (branch, tag or commit sha)")
    params: dict[str, Any] = Field(default_factory=dict, description="the dataset's own keys")
    skip: int = Field(
        0,
        ge=0,
        description="leave out the first `skip` usable documents of the suite seed's order "
        "(the documents a suite entry with prompts <= skip draws its prompts from)",
    )
    tokenizer: str | None = Field(
        None, description="tokenizer of the documents, a model id or folder (default: the target's name_or_path)"
    )

    def dataset_entry(self) -> dict[str, Any]:
        """The suite ``datasets:`` entry this corpus reads (its keys without ``tokenizer``), for the data loaders."""
        return self.model_dump(exclude={"tokenizer"}, exclude_defaults=True) | {"name": self.name}


@dataclass(frozen=True)
class Corpus:
    """A declared corpus's documents as token ids, handed to a decoder by the harness.

    Attributes:
        key: identity of the corpus (its spec, the tokenizer, the seed): equal keys hold equal documents, so a decoder
            may cache what it builds from them by this key.
        documents: token ids of each document, in the seeded order, the held-out prompt documents left out.
    """

    key: str
    documents: tuple[tuple[int, ...], ...]
