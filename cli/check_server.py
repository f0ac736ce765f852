"""``dtbench check --server URL [--reference URL]`` and ``dtbench check --suite FILE LABEL`` (issue 66): the server
kit (:mod:`dtbench.harness.serving.kit`) against a served engine, printed as the decoder kit's table, each failure
with a counterexample ready to file (both requests as ``curl``, the prompt's SHA-256, the first differing position,
both tokens and their text, the margin and the noise, the engines' version and model), each passing check's ties
listed. Exit codes as ``dtbench check``: 0 nothing failed, 1 a check failed (the server died or hung included), 2 bad
input. API keys come from the environment only (``--api-key-env NAME``, a suite's ``api_key_env``) and are masked
in everything printed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import click
from rich.text import Text

from dtbench.core import DtbenchError, scrub_secrets
from dtbench.harness.safetext import printable

# how each verdict is shown, for decoders and served engines alike (cli/check.py's table too)
STYLE = {
    "passed": "green",
    "failed": "bold red",
    "error": "bold red",
    "xpass": "bold red",
    "n/a": "dim",
    "reported": "yellow",
    "xfail": "yellow",
    "skipped": "dim",
}
SHOWN = {"failed": "FAILED", "xpass": "XPASS", "error": "error"}


def _params(url: str, engine: str, served_model: str | None, api_key_env: str | None, tie_margin: float | None,
            timeout: float) -> Any:  # fmt: skip
    from dtbench.harness.serving.params import ServerParams

    fields: dict[str, Any] = {"engine": engine, "base_url": url, "request_timeout_s": timeout}
    if served_model:
        fields["model"] = served_model
    if api_key_env:
        fields["api_key_env"] = api_key_env
    if tie_margin is not None:
        fields["tie_margin"] = tie_margin
    try:
        return ServerParams(**fields)
    except Exception as exc:  # pydantic's ValidationError: its first message
        raise DtbenchError(f"--server/--reference: {_first_error(exc)}") from None


def _first_error(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        return f"{'.'.join(str(p) for p in first.get('loc', ()))}: {first.get('msg')}"
    return str(exc).splitlines()[0]


def _suite_entry(path: str, label: str) -> tuple[Any, Any, Any]:
    """(suite, the server entry's params, the reference's params or None) of the entry labelled ``label``.

    Raises:
        DtbenchError: no such entry, or it is not a ``server`` decoder.
    """
    from dtbench.harness.serving.params import ServerParams
    from dtbench.harness.suites.suitefile import load_suite

    suite, _ = load_suite(path)
    servers = [d for d in suite.decoders if d.name == "server"]
    found = [d for d in servers if (d.label or d.name) == label]
    if not found:
        known = ", ".join(repr(d.label or d.name) for d in servers) or "none"
        raise DtbenchError(f"{path} has no server entry labelled {label!r} (its server entries: {known})")
    try:
        params = ServerParams(**found[0].params)
        reference = ServerParams(**params.reference) if params.reference else None
    except Exception as exc:
        raise DtbenchError(f"{path}, entry {label!r}: {_first_error(exc)}") from None
    return suite, params, reference


@dataclass
class _Engines:
    """What a served check runs against: the engine's label, params, URL and launched process (None: not launched),
    the reference's (None: no reference), the tokenizer's model, the dataset entry and max T."""

    label: str
    params: Any
    url: str
    launched: Any
    ref_params: Any
    ref_url: str | None
    ref_launched: Any
    target: Any
    docs: Any
    max_T: int


def _engines(o: dict[str, Any], pool: Any) -> _Engines:
    """The engines of ``dtbench check --server``/``--suite`` (a suite's are launched now, with their reference).

    Raises:
        DtbenchError: bad input; ServerError: a launched server that did not start.
    """
    from dtbench.harness.suites.grouping import CellKey
    from dtbench.harness.suites.suite import DatasetSpec, ModelSpec

    timeout, margin, C = o["request_timeout"], o["tie_margin"], o["concurrency"]
    if o["suite_path"] is None:
        if o["server"] is None:
            raise DtbenchError("name a served engine: --server URL (and --reference URL) or --suite FILE LABEL")
        args = (o["engine"], o["served_model"], o["api_key_env"], margin, timeout)
        ref = _params(o["reference"], *args) if o["reference"] else None
        return _Engines("engine", _params(o["server"], *args), o["server"], None, ref, o["reference"], None,
                        ModelSpec(model=o["tokenizer_model"]), DatasetSpec(name=o["dataset"]), o["max_tokens"] or 32)  # fmt: skip
    label = o["names"][0]
    suite, params, ref_params = _suite_entry(o["suite_path"], label)
    update = {"request_timeout_s": timeout, **({"tie_margin": margin} if margin is not None else {})}
    params = params.model_copy(update=update)
    T = o["max_tokens"] or min(max(suite.generation_lengths), 64)
    spec = suite.datasets[0]
    cell = CellKey(spec.key, 0, T, C)
    click.echo(f"launching {label!r}" + (" and its reference" if ref_params else "") + f" from {o['suite_path']}",
               err=True)  # fmt: skip
    url, launched = pool.endpoint(label, params, cell, C)
    ref_url, ref_launched = None, None
    if ref_params is not None:
        ref_params = ref_params.model_copy(update={"request_timeout_s": timeout})
        ref_url, ref_launched = pool.endpoint(f"{label} reference", ref_params, cell, C)
    return _Engines(label, params, url, launched, ref_params, ref_url, ref_launched, suite.target, spec, T)


def _check_input(o: dict[str, Any]) -> None:
    from dtbench.harness.serving.kit import SERVER_CHECKS

    unknown = [c for c in o["checks"] if c not in SERVER_CHECKS]
    if unknown:
        raise DtbenchError(f"--check {unknown[0]} is a decoder check; a served engine has: {', '.join(SERVER_CHECKS)}")
    if o["all_"]:
        raise DtbenchError("--all checks decoders; a served engine is --server URL or --suite FILE LABEL")
    if o["reference"] and not o["server"]:
        raise DtbenchError("--reference URL needs --server URL (the engine to check against it)")
    if o["suite_path"] is not None and o["server"] is not None:
        raise DtbenchError("give --server URL or --suite FILE LABEL, not both")
    if o["suite_path"] is not None and len(o["names"]) != 1:
        raise DtbenchError("--suite FILE takes one server entry's label: dtbench check --suite FILE LABEL")
    if o["server"] is not None and o["names"]:
        raise DtbenchError("--server URL checks one engine: give no decoder names with it")


def run_server_check(o: dict[str, Any]) -> int:
    """Check one served engine (see the module docstring) with ``dtbench check``'s parsed options ``o``; returns the
    exit code: 0 nothing failed, 1 a check failed or a launched server did not start.

    Raises:
        DtbenchError: bad input (a check that is no server check, a missing suite entry, an unset key variable, a
            tokenizer that cannot be loaded): one line, exit 2.
    """
    from dtbench.harness.data.datasets import load_documents
    from dtbench.harness.models.loading import load_tokenizer
    from dtbench.harness.serving.endpoint import Endpoint
    from dtbench.harness.serving.kit import Session, run_checks
    from dtbench.harness.serving.process import ServerError, ServerPool
    from dtbench.harness.serving.prompt_space import PromptSpace

    _check_input(o)
    pool = ServerPool()
    try:
        try:
            e = _engines(o, pool)
        except ServerError as exc:  # a server that does not start fails every check: the decoder kit's load row
            _line(
                output_console(), "FAILED", f"{o['names'][0] if o['names'] else 'engine'}: could not be checked: {exc}"
            )
            return 1
        tokenizer = load_tokenizer(e.target)
        try:
            documents = [
                text for _, text in load_documents(e.docs, o["data_dir"] or os.environ.get("DTBENCH_DATA_DIR"))
            ]
        except DtbenchError as exc:  # no text prompts: the other kinds still run
            click.echo(f"note: no dataset text prompts ({exc})", err=True)
            documents = []
        engine = Endpoint(e.label, e.params, e.url, e.launched, tokenizer)
        reference = None
        if e.ref_params is not None and e.ref_url is not None:
            reference = Endpoint(f"{e.label} reference", e.ref_params, e.ref_url, e.ref_launched, tokenizer)
        n_ctx = o["context_length"] or engine.identity().get("n_ctx")
        eos = getattr(tokenizer, "eos_token_id", None)
        session = Session(
            engine=engine,
            reference=reference,
            space=PromptSpace(tokenizer, documents, n_ctx if isinstance(n_ctx, int) else None, e.max_T),
            deadline=time.monotonic() + o["budget"],
            max_T=e.max_T,
            concurrency=o["concurrency"],
            eos=frozenset([eos] if isinstance(eos, int) else eos or []),
            examples=o["examples"],
            shrink=not o["no_shrink"],
        )

        def progress(out: Any) -> None:
            shown = f"  {printable(out.decoder)} {out.check} {SHOWN.get(out.status, out.status)} {out.seconds:.1f} s"
            click.echo(scrub_secrets(shown), err=True)

        outcomes = run_checks(session, list(o["checks"]) or None, progress)
    except ServerError as exc:
        raise DtbenchError(str(exc)) from None
    finally:
        pool.close()  # a launched server never outlives the command
    _report(e.label, outcomes, engine, reference, o)
    return 1 if any(out.status == "failed" for out in outcomes) else 0


def _report(label: str, outcomes: list[Any], engine: Any, reference: Any, o: dict[str, Any]) -> None:
    if o["fmt"] != "json":
        _print(label, outcomes, engine, reference, o["budget"])
        return
    doc = {
        "engine": label,
        "ok": not any(out.status == "failed" for out in outcomes),
        "requests": {"engine": engine.sent, "reference": reference.sent if reference else 0},
        "outcomes": [
            {
                "check": out.check,
                "status": out.status,
                "detail": out.detail,
                "seconds": out.seconds,
                "counterexample": out.counterexample or None,
            }  # fmt: skip
            for out in outcomes
        ],
    }
    click.echo(scrub_secrets(json.dumps(doc, indent=1, default=str)))


def _print(label: str, outcomes: list[Any], engine: Any, reference: Any, budget: float) -> None:
    from rich.table import Table

    from dtbench.reports.rendering import output

    console = output.stdout()
    title = (
        f"dtbench check: served engine {label!r} at {engine.shown_url}"
        if label != "engine"
        else (f"dtbench check: served engine at {engine.shown_url}")
    )
    table = Table(title=printable(title))
    for head in ("check", "verdict", "seconds", "what it ran"):
        table.add_column(head)
    for o in outcomes:
        table.add_row(
            Text(o.check.replace("_", " ")),
            Text(SHOWN.get(o.status, o.status), style=STYLE.get(o.status, "")),
            f"{o.seconds:.1f}",
            Text(printable(scrub_secrets(o.detail if o.status != "failed" else "see below"))),
        )
    console.print(table)
    for o in outcomes:
        if o.status == "failed":
            _line(console, "FAILED", f"{label}: {o.check}: {o.detail}")
            _counterexample(console, o.counterexample)
    for o in outcomes:
        listed = (o.counterexample or {}).get("ties", []) if o.status == "passed" else []
        if len(listed) > TIES_SHOWN:
            console.print(Text(f"{o.check}: {len(listed)} ties, the first {TIES_SHOWN} (all: --format json)"))
        for tie in listed[:TIES_SHOWN]:
            a, b = tie.get("reference_token") or {}, tie.get("engine_token") or {}
            _line(
                console,
                "tie",
                f"{o.check}: position {tie.get('position')}: {b.get('id')} {b.get('text')!r} instead of "
                f"{a.get('id')} {a.get('text')!r}, margin {_num(tie.get('margin'))} <= max(tie_margin "
                f"{_num(tie.get('tie_margin'))}, noise {_num(tie.get('noise'))}); prompt sha256 "
                f"{tie.get('prompt_sha256', '')[:16]}... ({tie.get('prompt_tokens')} tokens)",
                style="yellow",
            )
    n_failed = sum(o.status == "failed" for o in outcomes)
    passed = sum(o.status == "passed" for o in outcomes)
    ties = sum(len((o.counterexample or {}).get("ties", [])) for o in outcomes if o.status == "passed")
    console.print(
        Text(
            f"{len(outcomes)} checks: {passed} passed, {n_failed} failed"
            + (f", {ties} tie(s)" if ties else "")
            + f"; {engine.sent} requests to the engine"
            + (f", {reference.sent} to the reference" if reference is not None else "")
            + f" (budget {budget:g} s)"
        )
    )


TIES_SHOWN = 10  # ties listed per check in the table format


def output_console() -> Any:
    from dtbench.reports.rendering import output

    return output.stdout()


def _num(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, int | float) else "n/a"


def _line(console: Any, head: str, text: str, style: str = "bold red") -> None:
    line = Text(head, style=style)
    line.append(f" {printable(scrub_secrets(text))}")
    console.print(line, soft_wrap=True)


def _counterexample(console: Any, c: dict[str, Any]) -> None:
    """The failure's counterexample as lines a user pastes into a bug report."""

    def say(text: str) -> None:
        console.print(Text(f"  {printable(scrub_secrets(text))}"), soft_wrap=True)

    if not c:
        return
    if "prompt_sha256" in c:
        shrunk = c.get("shrunk") or {}
        how = (
            f" (shrunk from {shrunk['from_size']} tokens in {shrunk['tries']} tries)"
            if shrunk and shrunk.get("from_size", 0) > shrunk.get("to_size", 0)
            else ""
        )
        say(f"prompt: {c['prompt_tokens']} tokens, sha256 {c['prompt_sha256']}{how}")
        say(f"prompt text: {json.dumps(c.get('prompt_text', ''))[:400]}")
        say(f"prompt ids: {json.dumps(c.get('prompt'))[:400]}")
    if "T" in c:
        say(f"max_tokens {c['T']}" + (f", stop at EOS {c['stop_at_eos']}" if "stop_at_eos" in c else ""))
    if c.get("position") is not None and "engine_token" in c:
        a, b = c.get("reference_token") or {}, c.get("engine_token") or {}
        say(
            f"first difference at output position {c['position']}: engine {b.get('id')} {b.get('text')!r}, "
            f"reference {a.get('id')} {a.get('text')!r}; the reference's margin {_num(c.get('margin'))} nats, "
            f"noise {_num(c.get('noise'))}, tie_margin {_num(c.get('tie_margin'))}: not a tie"
        )
    for key, who in (("engine", "engine"), ("reference_engine", "reference")):
        ident = c.get(key)
        if isinstance(ident, dict):
            say(
                f"{who}: {ident.get('label')} ({ident.get('engine')}) at {ident.get('url')}, version "
                f"{ident.get('version', 'not reported')}, model {ident.get('model', 'not reported')}"
            )
    curl = c.get("curl")
    if isinstance(curl, dict):
        for who, cmd in curl.items():
            say(f"{who} request: {cmd}")
    elif isinstance(curl, str):
        say(f"request: {curl}")
    rest = {k: v for k, v in c.items() if k in ("stop", "text", "expected_text", "streamed", "not_streamed",
                                                 "first", "second", "tokens", "finish_reason", "acceptance")}  # fmt: skip
    if rest:
        say(f"details: {json.dumps(rest, default=str)[:1000]}")
