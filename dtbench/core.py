"""What every layer of dtbench shares, without torch: the user-facing error, strict pydantic types and the corpus
declaration a decoder's params may hold.

Importing this module imports pydantic only, so the suite schema and loader (:mod:`dtbench.harness.suites.suite`,
:mod:`dtbench.harness.suites.suitefile`), which build on it, load without torch (tests/test_import_graph.py checks it).
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
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_ECHO = 200  # characters of a user's value echoed in an error message


class DtbenchError(Exception):
    """A user-facing error: bad suite, missing data, unknown model or decoder, unusable database.

    The message is one line that says what is wrong and, where possible, how to fix it; the CLI prints it and exits
    non-zero (never a traceback).
    """


# --- secrets in URLs: masked by parsing the URL, not by a pattern of allowed characters (issues 42 and 50) ---------

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_AUTHORITY_END = re.compile(r"[/?#\r\n]")  # what ends a URL's authority (urllib's netloc rule; a line ends a URL)
_PATH_END = re.compile(r"[?#\s]")  # what ends a path in free text (a URL holds no raw whitespace)
_QUERY_END = re.compile(r"[#\s]")
_FRAGMENT_END = re.compile(r"\s")
_CLOSING_QUOTE = re.compile(r"[\"'](?=\s*(?:[,:;)\]}]|$))")
_CLOSERS = "\"'`,;)]}>"  # closing punctuation after a URL in free text: kept, never part of a masked value
_NAME_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
SECRET_WORDS = frozenset(
    {
        "key",
        "apikey",
        "token",
        "secret",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "auth",
        "authorization",
        "bearer",
        "signature",
        "sig",
        "credential",
        "credentials",
        "jwt",
        "session",
        "sessionid",
    }
)
_SECRET_ENDINGS = ("key", "token", "secret", "password", "passwd", "signature", "credential")
MASK = "***"


def secret_name(name: str) -> bool:
    """Whether a query parameter or request field named ``name`` looks like it holds a credential: one of its words
    (split at ``_``, ``-``, ``.``, digits and camelCase) is a credential word (``key``, ``token``, ``secret``,
    ``password``, ``auth``, ``signature``, ``sig``, ``credential``, ...: ``api_key``, ``X-Amz-Signature``,
    ``accessToken``), or its letters end in one (``apikey``, ``accesstoken``); ``max_tokens`` is no credential."""
    words = {w.lower() for w in _NAME_WORDS.findall(name)}
    letters = "".join(c for c in name.lower() if c.isalnum())
    return bool(words & SECRET_WORDS) or letters.endswith(_SECRET_ENDINGS)


# --- secrets by value (issue 59 item 1): what the run knows is a secret is masked wherever it appears --------------

MIN_SECRET = 4  # characters: a shorter value (a password "ab") would mask ordinary text wherever it appears
_SECRETS: set[str] = set()
_ORDERED: tuple[str, ...] = ()  # the registered values, longest first (a value holding another is masked whole)
_SPLIT: re.Pattern[str] | None = None  # the registered values broken across lines anywhere (issue 67 item 1)
_BREAK = r"(?:\r?\n|\\r\\n|\\n)[ \t]*"  # a line break, real or JSON/repr-escaped, and the next line's indent


def register_secret(value: str | None) -> None:
    """Register ``value`` (an API key, a password) as a secret of this process: :func:`scrub_secrets` (and so
    :func:`redact_credentials`, every message, printed text and stored value) replaces it with ``***`` wherever it
    appears, as GitHub Actions masks a registered secret in its logs, in the encodings a server may echo it in: as
    given, percent-encoded (``quote``, ``quote_plus``), JSON-escaped, lower- and upper-cased and as Python's ``repr``
    escapes it (a traceback's), and each of those broken across two lines anywhere. Values shorter than :data:`MIN_SECRET`
    characters are not registered (issue 59 item 1)."""
    global _ORDERED
    if not value or len(value) < MIN_SECRET:
        return
    import json
    from urllib.parse import quote, quote_plus

    forms = {value, quote(value, safe=""), quote_plus(value), json.dumps(value)[1:-1]}
    forms.add(json.dumps(value, ensure_ascii=False)[1:-1])
    forms |= {value.lower(), value.upper(), repr(value)[1:-1]}  # echoed lower-cased, or escaped in a repr (issue 67)
    if forms <= _SECRETS:
        return
    _SECRETS.update(forms)
    _ORDERED = tuple(sorted(_SECRETS, key=len, reverse=True))
    _compile_split()


def _compile_split() -> None:
    """One pattern matching every registered value with a line break (and indent) between any two of its characters:
    a key a server echoes wrapped over two lines (issue 67 item 1)."""
    global _SPLIT
    gap = f"(?:{_BREAK})?"
    alternatives = [gap.join(re.escape(c) for c in form) for form in _ORDERED if len(form) > 1]
    _SPLIT = re.compile("|".join(alternatives)) if alternatives else None


def register_url_secrets(url: str | None) -> None:
    """Register the secrets of a URL (:func:`register_secret`): its password (with its user where the password alone
    is shorter than :data:`MIN_SECRET`) and the base64 of ``user:password`` (the ``Authorization: Basic`` header
    httpx sends for a URL with credentials; a lone user part, a token, as ``user:``), each as written and
    percent-decoded, and the value of every query or fragment parameter whose name looks like a credential
    (:func:`secret_name`). A URL urllib cannot split registers nothing (issue 59 item 1)."""
    import base64
    from urllib.parse import parse_qsl, urlsplit

    if not url or "://" not in url:
        return
    try:
        parts = urlsplit(url)
    except ValueError:
        return
    userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
    if userinfo:
        user, colon, password = userinfo.partition(":")
        for u, p in ((user, password), (unquote(user), unquote(password))):
            register_secret(p if colon else u)  # the user name is kept where shown: user:***@host
            if len(p if colon else u) < MIN_SECRET:
                register_secret(f"{u}:{p}")  # a password too short to mask alone is masked with its user
            for encoding in ("utf-8", "latin-1"):
                try:
                    register_secret(base64.b64encode(f"{u}:{p}".encode(encoding)).decode())
                except UnicodeEncodeError:
                    pass
    for text in (parts.query, parts.fragment):
        for name, value in parse_qsl(text, keep_blank_values=False):
            if secret_name(name):
                register_secret(value)


def scrub_secrets(text: str) -> str:
    """``text`` with every registered secret (:func:`register_secret`) replaced by ``***`` (issue 59 item 1)."""
    for secret in _ORDERED:
        if secret in text:
            text = text.replace(secret, MASK)
    if _SPLIT is not None and ("\n" in text or "\\n" in text):  # a line break, real or escaped: a key wrapped over it
        text = _SPLIT.sub(MASK, text)
    return text


def forget_secrets() -> None:
    """Forget every registered secret (tests: one test's secrets are not another's)."""
    global _ORDERED, _SPLIT
    _SECRETS.clear()
    _ORDERED = ()
    _SPLIT = None


def _mask_userinfo(userinfo: str) -> str:
    if not userinfo:
        return userinfo
    user, colon, _ = userinfo.partition(":")
    return f"{user}:{MASK}" if colon else MASK  # a lone user part is often a token (https://TOKEN@host): masked whole


def _mask_query(query: str) -> str:
    """A query string (without ``?``) or a fragment (without ``#``) with every value of a credential-like parameter
    masked; closing punctuation after the last value (a quote or bracket of the text around the URL) is kept."""
    stripped = query.rstrip(_CLOSERS)
    query, tail = stripped, query[len(stripped) :]
    parts = []
    for part in query.split("&"):
        name, eq, value = part.partition("=")
        if eq and value and secret_name(unquote(name)):
            part = f"{name}={MASK}"
        elif "://" in value:  # a URL in a parameter (a redirect): its own credentials
            part = f"{name}={redact_credentials(value)}"
        elif not eq and "://" in part:  # a URL as the whole part (?http://u:p@x, #http://...)
            part = redact_credentials(part)
        parts.append(part)
    return "&".join(parts) + tail


def _authority_end(text: str, start: int, whole: bool) -> int:
    """Where the authority starting at ``start`` ends: at ``/``, ``?``, ``#`` or a line break (urllib's rule), and in
    free text (``whole`` False) also where another URL starts or at a quote closing a string (a quote followed by
    ``,`` ``:`` ``;`` ``)`` ``]`` ``}`` or the end of the text: the text around a URL in JSON or a repr)."""
    end = _AUTHORITY_END.search(text, start)
    stop = end.start() if end else len(text)
    if whole:
        return stop
    if (other := _SCHEME.search(text, start)) is not None and other.start() < stop:
        stop = other.start()
    if (quote := _CLOSING_QUOTE.search(text, start, stop)) is not None and text.rfind("@", start, stop) > quote.start():
        stop = quote.start()
    return stop


def _mask_at(text: str, start: int, whole: bool, by_value: bool = True) -> tuple[str, int]:
    """The URL whose authority starts at ``start`` (just after ``scheme://``) masked: (its masked text, where the
    scan goes on). The userinfo runs to the *last* ``@`` before the authority ends (:func:`_authority_end`), so
    quotes, spaces, ``<`` and ``@`` in a password are masked with it; a query (up to ``#`` or whitespace) and a
    fragment (up to whitespace) have their credential-like parameters masked."""
    stop = _authority_end(text, start, whole)
    at = text.rfind("@", start, stop)
    out = _mask_userinfo(text[start:at]) + text[at:stop] if at >= 0 else text[start:stop]
    path_end = _PATH_END.search(text, stop)
    query = path_end.start() if path_end else len(text)
    if query == len(text) or text[query] not in "?#":
        return out, stop  # the scan goes on over the path (a URL inside it is found there)
    out += redact_credentials(text[stop:query], by_value)
    pos = query
    if text[pos] == "?":
        q_end = _QUERY_END.search(text, pos + 1)
        q_stop = q_end.start() if q_end else len(text)
        out, pos = out + "?" + _mask_query(text[pos + 1 : q_stop]), q_stop
    if pos < len(text) and text[pos] == "#":  # a fragment's parameters (#access_token=...: issue 59 item 2)
        f_end = _FRAGMENT_END.search(text, pos + 1)
        f_stop = f_end.start() if f_end else len(text)
        out, pos = out + "#" + _mask_query(text[pos + 1 : f_stop]), f_stop
    return out, pos


def mask_urls(value: Any) -> str:
    """``str(value)`` with the credentials of every URL in it masked by *structure* only (:func:`redact_credentials`
    without masking registered secrets by value): what dtbench stores and prints of text the user wrote (a suite's
    text, labels, dataset names, params, the environment record; issue 67 item 1). Those are refused at validate when
    they hold a literal key, so searching them for a key's value could only rewrite the user's own words: with a key
    ``wiki``, a dataset ``wikitext-2`` was stored as ``***text-2``. SQLAlchemy's ``URL.render_as_string(
    hide_password=True)`` hides by structure the same way, never by searching text."""
    return redact_credentials(value, by_value=False)


def redact_credentials(value: Any, by_value: bool = True) -> str:
    """``str(value)`` with the credentials of every URL in it masked: the password of ``http://user:secret@host``
    (``http://user:***@host``, the form SQLAlchemy's ``hide_password`` shows a database URL in), a user part without
    a password (``https://TOKEN@host``: ``***@``), and the value of every query or fragment parameter whose name
    looks like a credential (:func:`secret_name`: ``?api_key=***``, ``#access_token=***``). First, every secret
    registered by value (:func:`register_secret`: an API key read from ``api_key_env``, a URL's password and its
    ``Authorization: Basic`` form) is masked wherever it appears (:func:`scrub_secrets`, issue 59 item 1).

    Each URL is read the way urllib splits one: its userinfo runs to the last ``@`` of its authority, which ends at
    ``/``, ``?``, ``#`` or a line break; quotes, spaces and brackets do not end it, so a password holding them is
    masked whole (issue 50; in free text, what follows a URL without a path up to the next ``@`` of its line is
    masked with it: too much, never too little).

    The one rule for secrets in URLs (issue 42 item 1): every message (:func:`clip`), every printed or rendered text
    (``harness/safetext.printable``) and every value written to the database (:func:`redact_json`, and a suite's
    text: :func:`redact_yaml`) goes through it. The request itself still uses the URL as given. Secrets are masked by
    value (``by_value``) only in text from outside dtbench (a server's answers and errors, exceptions, a child's
    output): what the user wrote goes through :func:`mask_urls` (issue 67 item 1)."""
    text = scrub_secrets(str(value)) if by_value else str(value)
    if "://" not in text:
        return text
    whole = _SCHEME.match(text) is not None and "\n" not in text  # the text is one URL: urllib's rule alone
    out, pos = [], 0
    while (m := _SCHEME.search(text, pos)) is not None:
        masked, end = _mask_at(text, m.end(), whole and m.start() == 0, by_value)
        out.append(text[pos : m.end()] + masked)
        pos = end
    out.append(text[pos:])
    return "".join(out)


def redact_yaml(text: str) -> str:
    """A YAML document (a suite's text) with every URL credential masked by structure: :func:`mask_urls` over the
    text, then each scalar whose *parsed* value still holds a URL credential (split by YAML's escapes, quoting or line
    folding) rewritten in place as a double-quoted scalar of its masked value; the rest of the text is kept byte for
    byte. Text that is no YAML gets :func:`mask_urls` only. No registered secret is searched for: a suite holding a
    literal key is refused at validate, and a key's value found in the user's own words is no key (issue 67 item 1)."""
    import json

    import yaml

    text = mask_urls(text)
    if "://" not in text:  # no URL: no scalar can hold a URL's credentials (a literal key is refused at validate)
        return text
    try:
        roots = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except (yaml.YAMLError, RecursionError):
        return text
    edits = []
    for node in _scalars(roots):
        masked = mask_urls(node.value)
        if masked != node.value:
            edits.append((node.start_mark.index, node.end_mark.index, json.dumps(masked)))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def _scalars(roots: list[Any]) -> list[Any]:
    """Every scalar node under ``roots`` (a YAML node graph), each once (an alias is its anchor's node)."""
    import yaml

    out, seen, stack = [], set(), list(roots)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            out.append(node)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            stack.extend(x for pair in node.value for x in pair)
    return out


def redact_json(value: Any, by_value: bool = True) -> Any:
    """A JSON-like value (dicts, lists, strings, numbers) with :func:`redact_credentials` applied to every string,
    keys included (``by_value`` False: :func:`mask_urls`, for what the user wrote); other values unchanged (a new
    container only where something changed is not promised)."""
    if isinstance(value, str):
        return redact_credentials(value, by_value)
    if isinstance(value, dict):
        return {
            redact_json(k, by_value) if isinstance(k, str) else k: redact_json(v, by_value) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(redact_json(v, by_value) for v in value)
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
        raise DtbenchError(f"{what} {path} is larger than {limit:,} bytes (the limit for a {what})")
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
    (:func:`dtbench.harness.data.selection.held_out_documents`) with the suite's seed: the first ``skip`` usable documents of
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
