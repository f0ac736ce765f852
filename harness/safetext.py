"""Text from users (suite names, labels, errors) made safe to show: in a terminal, Markdown and spreadsheets.

A suite's strings end up in terminal tables, Markdown, CSV, HTML and the progress bar. Suites refuse control
characters in names and labels (:func:`control_character`, used by the schema), but a database written before that
check, or a decoder's error text, can still hold them, so every renderer also escapes what it prints:

* :func:`printable`: control characters (C0, DEL, C1, and the bidirectional overrides of "Trojan Source",
  CVE-2021-42574) shown as ``\\x1b``-style escapes, so ESC ``[31m`` or ESC ``]0;title`` BEL cannot restyle the
  terminal or retitle its window;
* :func:`markdown_cell`: :func:`printable`, HTML's ``&``, ``<`` and ``>`` as entities (Markdown viewers render
  raw HTML, so a label ``<script>`` or ``<img onerror=...>`` would run there), a line break as ``<br>`` and Markdown's
  link, code and cell syntax (``[ ] | ` \\``) backslash-escaped, so a cell stays one cell of one row and a label
  ``[c](javascript:...)`` never becomes a link;
* :func:`html_text`: :func:`printable`, then :func:`html.escape` (a NUL or ESC never reaches an HTML page raw);
* :func:`csv_cell` / :func:`to_csv`: OWASP's rule against CSV (formula) injection
  (https://owasp.org/www-community/attacks/CSV_Injection): a text cell starting with ``=``, ``+``, ``-``, ``@``, a
  tab or a carriage return gets a leading ``'`` so spreadsheets show it as text and never evaluate it. Numbers
  stay numbers: numeric columns are untouched, and so is a text cell that is a plain number (``-5``, ``+3.2%``).
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from dtbench.core import mask_urls

if TYPE_CHECKING:  # pandas loads with the first CSV, not with every command that escapes a line of text
    import pandas as pd

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_PLAIN_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?%?")


def control_character(text: str) -> str | None:
    """The first control character of ``text`` as an escape (``\\x1b``), or None when it has none."""
    m = _CONTROL.search(text)
    return None if m is None else _escape(m)


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: Any) -> str:
    """``str(text)`` with every control character written as an escape (``\\x1b``, ``\\x07``, ``\\n``-> ``\\x0a``)
    and the credentials of any URL in it masked (``user:***@``, :func:`dtbench.core.redact_credentials`): every
    renderer (terminal, Markdown, CSV, HTML) goes through here, so a database written before issue 42 never shows a
    server's password either."""
    return _CONTROL.sub(_escape, mask_urls(text))


def html_text(text: Any) -> str:
    """``str(text)`` for an HTML page: control characters as escapes (:func:`printable`), then ``&<>"'`` as
    entities (:func:`html.escape`)."""
    return html.escape(printable(text))


# what makes links (every form needs "[" "]" or "<"; "(" alone links nothing, so "(0.9-1.4)" stays as written),
# code spans and cells, and the escape character itself
_MARKDOWN_SPECIAL = re.compile(r"([\\`\[\]|])")


def markdown_cell(text: Any) -> str:
    """One Markdown table cell (or title, caption, note): HTML escaped (``<`` as ``&lt;``: Markdown viewers render
    raw HTML), line breaks as ``<br>``, other control characters escaped, and the characters that make links, code
    spans and table cells (``\\ ` [ ] |``) backslash-escaped, so a label ``[c](javascript:alert(1))`` is shown as
    text, never as a live link, and a cell stays one cell (issue 50 item 4; CommonMark's backslash escapes)."""
    lines = re.split(r"\r\n|\r|\n", "" if text is None else str(text))
    return "<br>".join(_MARKDOWN_SPECIAL.sub(r"\\\1", html.escape(printable(line), quote=False)) for line in lines)


def csv_cell(value: Any) -> Any:
    """A CSV value: text neutralised against formula injection (OWASP) and control characters escaped; anything
    else unchanged."""
    if not isinstance(value, str):
        return value
    value = printable(value)
    if value.startswith(_FORMULA_START) and not _PLAIN_NUMBER.fullmatch(value):
        return "'" + value
    return value


def csv_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with :func:`csv_cell` applied to its text columns and its column names."""
    import pandas as pd

    out = frame.copy()
    for col in out.columns:
        if pd.api.types.is_object_dtype(out[col]) or pd.api.types.is_string_dtype(out[col]):
            out[col] = out[col].map(csv_cell)
    out.columns = [csv_cell(c) if isinstance(c, str) else c for c in out.columns]
    return out


@overload
def to_csv(frame: pd.DataFrame, path: None = None) -> str: ...


@overload
def to_csv(frame: pd.DataFrame, path: str | Path) -> None: ...


def to_csv(frame: pd.DataFrame, path: str | Path | None = None) -> str | None:
    """``frame.to_csv(index=False)`` after :func:`csv_frame`: the text, or None when written to ``path``."""
    return csv_frame(frame).to_csv(path, index=False) if path is not None else csv_frame(frame).to_csv(index=False)
