"""The conformance kit's ``compiled_equals_eager`` check (issue 56; B > 1 since issue 59 item 6): compiled execution
after the cell's own compile step (:func:`dtbench.harness.measurement.hardware.compile_decoder`) against eager execution of the same
decoder. Public through :mod:`dtbench.testing`; the other checks are in :mod:`dtbench.testing.checks`."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

from dtbench.testing.common import (
    FLAT,
    CheckFailed,
    NotApplicable,
    Precision,
    build,
    collect,
    collect_rows,
    compare,
    describe,
    distinct_rows,
    iter_params,
    pair,
    prompts,
    search,
)

if TYPE_CHECKING:
    import torch

Job = Any  # conformance_checks.Job (that module imports this one): cls, precision, settings(), params(), examples()

MAX_PROMPT, MAX_T = 20, 40  # the compiled check's draws: a static cache holds prompt + T + the decoder's headroom
MAX_LEN = 512  # one static cache length for every decoder of a process, as one run has (mixing lengths on the same
# models made transformers' compiled forward recompile: an artifact of the kit, not of a decoder)


@cache
def _execution(precision: Precision) -> Any:
    from dtbench.decoders import static_kv

    return static_kv.Execution(max_len=MAX_LEN)


@cache
def _compiled_pair(cls: type, precision: Precision) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The perturbed pair copied for one decoder class: its compiled graphs are its own, as a cell's are in the
    process the runner isolates it in (``isolation: process``, the default), never another decoder's."""
    import copy

    target, draft = pair("llama", "perturbed", FLAT, precision)
    return copy.deepcopy(target), copy.deepcopy(draft)


_COMPILED: set[tuple] = set()


def compiled_equals_eager(job: Job) -> None:
    """Compiled execution (static caches, bucketed ``torch.compile``) after the cell's own compile step equals eager
    execution of the same decoder, with zero recompiles inside the sample and only the buckets ``compiled_sizes``
    declares: at B = 1 and, for a decoder that batches, at B = 3 (ragged rows; each row equals its prompt decoded
    alone, eager; T = 32..40). T is drawn up to 40 while the compile step decodes 16 tokens, as a cell's does, so the shapes met
    only near T (a draft chain cut short) must be compiled by the step, not inside the sample (issue 59 item 6)."""
    from hypothesis import strategies as st

    cls = job.cls
    if not cls.compiles:
        raise NotApplicable("declares compiles = False")
    params = job.params(lambda p: cls.compile_error(p))

    def body(prompt, T, params):
        _compiled_case(job, [prompt], [T], params)

    strategies = {"prompt": prompts(2, MAX_PROMPT), "T": st.integers(1, MAX_T), "params": params}
    search(job.examples(3), strategies, body)
    if not cls.batching:
        return

    def batch_body(rows, params):  # 9 consecutive T past the compile step's 16 tokens: each way a chain of K <= 8 ends
        _compiled_case(job, rows, range(MAX_T - 8, MAX_T + 1), params)

    keep = lambda p: cls.compile_error(p) or cls.batching_error(p)  # noqa: E731
    declared = job.settings()
    rows = distinct_rows(3, 3, MAX_PROMPT, min_size=2)  # distinct ragged rows: identical ones hide a row swap
    if isinstance(declared, list):  # every declared setting at B = 3: a recompile hides in one K, not the others
        for p in iter_params(declared, keep):
            search(job.examples(1), {"rows": rows}, lambda rows, p=p: batch_body(rows, p))
    else:
        search(job.examples(1), {"rows": rows, "params": declared.filter(lambda p: keep(p) is None)}, batch_body)


def _compiled_case(job: Job, rows: list[list[int]], Ts: Sequence[int], params: Any) -> None:
    """Draws of :func:`compiled_equals_eager`: ``rows`` decoded compiled at each T of ``Ts`` (one compile step per
    decoder class, params, precision and B) against each row decoded alone, eager (once, at the largest T: a
    lossless decoder's output at T is the first T tokens of its output at a larger T)."""
    from dtbench.harness.measurement.hardware import compile_decoder

    cls, B = job.cls, len(rows)
    if MAX_PROMPT + MAX_T + cls.cache_headroom(params) > MAX_LEN:
        raise CheckFailed(
            f"declared setting needs a static cache over {MAX_LEN} positions", {"params": describe(params)}
        )
    ex = _execution(job.precision)
    target, draft = _compiled_pair(cls, job.precision)
    eager = [collect(build(cls, params, target, draft), p, max(Ts)) for p in rows]
    decoder = build(cls, params, target, draft)
    models = [target, draft] if cls.needs_draft else [target]
    key = (cls, params.model_dump_json(), job.precision, B)
    if key not in _COMPILED:
        compile_decoder(ex, decoder, rows, MAX_T, models)  # as a cell of T >= 16 compiles
        _COMPILED.add(key)
    for T in Ts:
        _compiled_sample(job, ex, decoder, models, rows, T, [e[:T] for e in eager])


def _compiled_sample(job: Job, ex: Any, decoder: Any, models: list, rows: list[list[int]], T: int, eager: list) -> None:
    """One compiled sample of ``rows`` at T, held to zero recompiles, the declared buckets and ``eager``."""
    from dtbench.decoders import static_kv

    cls, B, params, target = job.cls, len(rows), decoder.params, models[0]
    with static_kv.compiled(ex):
        ex.begin_sample()
        ex.used.clear()
        before = static_kv.compiled_graphs()
        outputs = [collect(decoder, rows[0], T)] if B == 1 else collect_rows(decoder, rows, T)
        recompiles = static_kv.compiled_graphs() - before
    shown = {("prompt" if B == 1 else "rows"): rows[0] if B == 1 else rows, "T": T, "params": describe(params)}
    if recompiles:
        raise CheckFailed(f"{recompiles} graph(s) compiled inside the sample at B = {B}, after the compile step", shown)
    largest = max(cls.verify_sizes(params))
    for role, model, sizes in zip(("target", "draft"), models, cls.compiled_sizes(params)):
        used = set().union(*(b for (m, _), b in ex.used.items() if m == id(model)))
        declared = set(static_kv.buckets_of(largest, sizes)) if sizes != () else set()
        if not used <= declared:
            raise CheckFailed(f"the {role} ran buckets {sorted(used - declared)} outside compiled_sizes", shown)
    for r, (output, expected) in enumerate(zip(outputs, eager)):
        diff = compare(job.precision, target, rows[r], output, expected, companions=(rows[:r] + rows[r + 1 :]) or None)
        if diff:
            where = "" if B == 1 else f" in row {r} of B = {B}"
            raise CheckFailed(
                f"compiled differs from eager{where} at position {diff.get('position')}: "
                f"eager {diff.get('expected')}, compiled {diff.get('got')}",
                {**shown, **diff},
            )
