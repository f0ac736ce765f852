"""The checks of a planned suite that read files but no model weights (split from :mod:`dtbench.harness.suites.plan`, which
expands and validates the suite itself): shared by ``dtbench validate`` and ``dtbench run``, before any model loads.
"""

from __future__ import annotations

from rich.console import Console

from dtbench.harness.data import datasets as data
from dtbench.harness.data import selection
from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.models import loading as models
from dtbench.harness.safetext import printable
from dtbench.harness.suites.plan import Plan
from dtbench.harness.suites.suite import Suite

CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME")


def check_cache_folders() -> None:
    """Each cache folder an environment variable names (torch's compile caches, Hugging Face's) is a folder or can
    become one: set to a file (or a path under one), loading a model fails with a bare ``File exists`` (issue 50).

    Raises:
        DtbenchError: one line naming the variable and the file.
    """
    import os
    from pathlib import Path

    for name in CACHE_VARIABLES:
        value = os.environ.get(name)
        if not value:
            continue
        path = Path(value).expanduser()
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            what = "a file" if existing == path else f"under the file {clip(printable(str(existing)), 200)}"
            raise DtbenchError(
                f"{name} names {clip(printable(value), 200)}, {what}, not a folder: point {name} at a folder or unset it"
            )


def preflight(suite: Suite, plan: Plan, console: Console) -> None:
    """Checks that read files but no model weights, shared by ``validate`` and ``run``: a ``text-files`` corpus is
    text; a question file parses and its categories exist; a chat template exists (``auto`` needs the target
    tokenizer's) and renders every prompt within its bounds; each decoder's own files pass its
    ``check_files(params)`` classmethod where it has one (a learned head's config.json and weights' header, REST's
    tokens file); a server decoder that launches ``{llama_server}`` finds the binary (``make engine``); L_max + T
    fits each model's context (a warning past a rotary model's trained context).

    Raises:
        DtbenchError: a cache folder variable naming a file (:func:`check_cache_folders`), a non-text document, a bad question file or category, a missing chat template, no
            llama-server for a ``{llama_server}`` launch, or L_max + T beyond a model's learned position table.
    """
    check_cache_folders()
    for ds in suite.datasets:
        try:
            data.check_dataset(ds, files=True)
            data.sample_slots(ds, suite.seed, plan.data_dir)  # question datasets: the file parses, categories exist
        except DtbenchError as exc:
            raise DtbenchError(f"{ds.where}: {exc}" if ds.where else str(exc)) from None
    for p in plan.decoders:  # a declared corpus's files (a text-files corpus is read here)
        corpus = p.cls.corpus_of(p.params)
        if corpus is not None:
            try:
                selection.check_corpus(corpus, suite.datasets, files=True)
            except DtbenchError as exc:
                where = f"{p.spec.where}: " if p.spec.where else ""
                raise DtbenchError(f"{where}decoder '{clip(p.label, 80)}': {exc}") from None
    if any(data.is_chat(ds) for ds in suite.datasets) and (suite.chat_template or "auto") != "none":
        from dtbench.harness.data import questions

        tokenizer = models.load_tokenizer(suite.target)  # auto without a template: one line, now
        for ds in suite.datasets:  # every prompt rendered under the template's bounds (chat.render)
            if data.sample_slots(ds, suite.seed, plan.data_dir) is not None:
                try:
                    questions.check_prompts(ds, tokenizer, suite, plan.data_dir)
                except DtbenchError as exc:
                    raise DtbenchError(f"{ds.where}: {exc}" if ds.where else str(exc)) from None
    for p in plan.decoders:  # a server's engine adapter, and a launched llama.cpp server's binary (make engine)
        if p.cls.requests:
            from dtbench.decoders.engines import engine_for
            from dtbench.harness.serving import launches_llama_server, llama_server_binary

            where = f"{p.spec.where}: " if p.spec.where else ""
            try:
                engine = getattr(p.params, "engine", None)
                if not isinstance(engine, str):  # the serving path reads every requests decoder through its engine
                    raise DtbenchError("a decoder measured through requests names its server's engine (params.engine)")
                engine_for(engine)
                if launches_llama_server(p.params):
                    llama_server_binary()
            except DtbenchError as exc:
                raise DtbenchError(f"{where}decoder '{clip(p.label, 80)}': {exc}") from None
    for p in plan.decoders:  # a decoder's own files (a head's config and weights' header, a tokens file)
        check = getattr(p.cls, "check_files", None)
        if check is not None:
            try:
                check(p.params)
            except (ValueError, DtbenchError) as exc:
                raise DtbenchError(f"decoder '{p.label}': {exc}") from None
    longest = max(l_max for ds in suite.datasets for l_max in ds.l_maxes) + max(suite.generation_lengths)
    specs = [suite.target]
    if suite.draft is not None and any(p.cls.needs_draft for p in plan.decoders):
        specs.append(suite.draft)
    for spec in specs:
        role = "target" if spec is suite.target else "draft"
        try:
            files = models.require_remote_code_opt_in(spec)
        except DtbenchError as exc:
            raise DtbenchError(f"{role}: {exc}") from None
        if files:
            console.print(
                f"warning: {role} '{printable(spec.model)}' sets trust_remote_code: true; loading it runs "
                f"{printable(', '.join(files))}",
                style="yellow",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        warning = models.check_context(spec, longest)
        if warning:
            console.print(f"warning: {printable(warning)}", style="yellow", markup=False, highlight=False)
