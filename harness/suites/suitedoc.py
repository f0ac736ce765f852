"""docs/suite-reference.md, generated from the suite schema's pydantic field descriptions (and the built-in decoders'
params models), so the reference never drifts from the code: tests/test_docs.py fails when the file is stale.

Regenerate: ``python -m dtbench.harness.suites.suitedoc --write`` (prints it without ``--write``).
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from dtbench.harness.suites.decoderspec import DecoderSpec, SamplingSpec
from dtbench.harness.suites.suite import DatasetSpec, ModelSpec, Suite

DOC = Path(__file__).resolve().parents[2] / "docs" / "suite-reference.md"
SECTIONS: list[tuple[str, type[BaseModel]]] = [
    ("The suite (top level)", Suite),
    ("`target:` and `draft:` (a model)", ModelSpec),
    ("`datasets:` (each entry)", DatasetSpec),
    ("`decoders:` (each entry)", DecoderSpec),
    ("`sampling:` (the suite's, or a decoder entry's)", SamplingSpec),
]


def type_text(annotation: Any) -> str:
    """A field's type as a reader writes it in YAML terms (``int | list[int]``, ``"sdpa" | "eager"``)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin in (list, dict, tuple, set):
        return f"{origin.__name__}[{', '.join(type_text(a) for a in args)}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        return {"NoneType": "null"}.get(annotation.__name__, annotation.__name__)
    return str(annotation).replace("typing.", "")


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        return f"`{json.dumps(field.default)}`"
    if field.default_factory is not None:
        value = field.default_factory()
        return f"`{json.dumps(value)}`" if not isinstance(value, BaseModel) else "(its defaults)"
    return "required"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def table(model: type[BaseModel]) -> list[str]:
    """One Markdown table row per field of ``model``: key (its alias), type, default, description."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        key = field.alias or name
        rows.append(
            f"| `{key}` | {_cell(type_text(field.annotation))} | {_cell(_default(field))} | "
            f"{_cell(field.description or '')} |"
        )
    return rows


def builtin_decoders() -> list[tuple[str, type[BaseModel]]]:
    """(name, Params model) of the decoders this distribution registers (plugins are not documented here)."""
    from importlib.metadata import distribution

    eps = [ep for ep in distribution("dtbench").entry_points if ep.group == "dtbench.decoders"]
    return [(ep.name, ep.load().Params) for ep in sorted(eps, key=lambda e: e.name)]


def reference_markdown() -> str:
    """The whole of docs/suite-reference.md."""
    out = [
        "# Suite reference",
        "",
        "Generated from the suite schema (`harness/suites/suite.py`) and the built-in decoders' params by "
        "`python -m dtbench.harness.suites.suitedoc --write`; do not edit by hand (tests/test_docs.py fails when it is "
        "stale). How to write a suite: [suites.md](suites.md). `prompt_cap` is the deprecated name of `L_max`.",
        "",
    ]
    for title, model in SECTIONS:
        doc = (model.__doc__ or "").strip().split("\n\n")[0]
        out += [f"## {title}", "", " ".join(doc.split()), "", *table(model), ""]
    out += [
        "## Decoder params (`params:` of a `decoders:` entry)",
        "",
        "Each built-in decoder's keys; `dtbench decoders` lists the installed ones, plugins included.",
        "",
    ]
    for name, params in builtin_decoders():
        rows = table(params)
        out += [f"### `{name}`", ""] + (rows if len(rows) > 2 else ["No params."]) + [""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = reference_markdown()
    if "--write" in argv:
        DOC.write_text(text)
        print(f"wrote {DOC}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
