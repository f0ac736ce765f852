"""The conformance kit's contract checks (issue 65 item 3): what every decoder owes its caller beyond its tokens, each
judged on what the decoder itself yields, never on what the runner's cut leaves of it. Public through
:mod:`dtbench.testing`; the other checks are in :mod:`dtbench.testing.checks`.

- ``deterministic``: the same prompt decoded greedily twice after the same history gives the same tokens and the same
  Step counts (scikit-learn's ``check_fit_idempotent``). It runs first: a nondeterministic decoder would otherwise
  fail another check on one run and pass it on the next, blamed for something else.
- ``length``: exactly T new tokens when EOS is not asked for: a decoder yielding more (a draft chain not capped at T,
  a loop bound off by one) burns forwards the runner's cut at T hides; one yielding fewer stops early.
- ``eos``: with stopping at EOS asked (``eos_token_id`` set), nothing after the first EOS it commits.
- ``inputs_unchanged``: the caller's ``input_ids`` (every row's at B > 1) are the same after generation as before
  (scikit-learn's ``check_estimators_overwrite_params``): a caller reusing its tensor must not get garbage.

The runner and :func:`~dtbench.testing.common.collect` cut at T and at EOS and hand each call a fresh tensor,
which is why these need checks of their own: the defects pass every other check and a run (stored lossless).
"""

from __future__ import annotations

from typing import Any

import torch

from dtbench.decoders.base import Decoder, Step, eos_ids
from dtbench.testing.common import (
    ARCHS,
    DRAFT_KINDS,
    FLAT,
    CheckFailed,
    NotApplicable,
    build,
    collect,
    describe,
    device_of,
    distinct_rows,
    pair,
    pairs_space,
    prompts,
    search,
)

Job = Any  # conformance_checks.Job (that module imports this one): cls, precision, params(), examples()
STEP_SLACK = 64  # Steps a drive allows beyond 4 per token before it calls the decoder endless (empty Steps included)


def _st() -> Any:
    from hypothesis import strategies as st

    return st


def drive(decoder: Decoder[Any], prompt: list[int], T: int, stop_after: int) -> tuple[list[Step], bool]:
    """The Steps ``decoder.generate`` yields on ``prompt`` at T, uncut: iterated until the generator ends, its tokens
    pass ``stop_after``, or it has yielded ``4 T + STEP_SLACK`` Steps. Returns (steps, whether the generator ended)."""
    steps: list[Step] = []
    n = 0
    gen: Any = decoder.generate(torch.tensor([prompt], device=device_of(decoder)), T)
    try:
        for step in gen:
            steps.append(step)
            n += len(step.tokens)
            if n > stop_after or len(steps) >= 4 * T + STEP_SLACK:
                return steps, False
        return steps, True
    finally:
        gen.close()


def drive_rows(decoder: Decoder[Any], rows: list[list[int]], T: int) -> tuple[list[list[int]], bool]:
    """Each row's tokens as ``generate_batch`` yields them at B = len(rows), uncut: iterated until the generator ends,
    a row passes T, or ``4 T + STEP_SLACK`` iterations. Returns (tokens per row, whether the generator ended)."""
    out: list[list[int]] = [[] for _ in rows]
    device = device_of(decoder)
    inputs = [torch.tensor([p], device=device) for p in rows]
    gen: Any = decoder.generate_batch(inputs, T)
    try:
        for i, step_of in enumerate(gen):
            for r, step in step_of.items():
                out[r].extend(int(t) for t in step.tokens)
            if any(len(r) > T for r in out) or i + 1 >= 4 * T + STEP_SLACK:
                return out, False
        return out, True
    finally:
        gen.close()


def _batched_params(job: Job) -> Any:
    """The declared settings that batch (a strategy), or None: the decoder does not batch, or none of its settings."""
    if not job.cls.batching:
        return None
    try:
        return job.params(lambda p: job.cls.batching_error(p))
    except NotApplicable:
        return None


def _tokens(steps: list[Step]) -> list[int]:
    return [int(t) for s in steps for t in s.tokens]


# --- deterministic ----------------------------------------------------------------------------------------------------


def _record(decoder: Decoder[Any], prompt: list[int], T: int) -> tuple[list[int], list[tuple[int, int, int, int]]]:
    """(tokens up to T, per Step (tokens, drafted, accepted, depth)) of one greedy decode, iteration stopped at T as the
    runner stops it."""
    steps, _ = drive(decoder, prompt, T, stop_after=T - 1)
    return _tokens(steps)[:T], [(len(s.tokens), s.drafted, s.accepted, s.depth) for s in steps]


def deterministic(job: Job) -> None:
    """The same prompt decoded greedily three times by fresh decoders: the second and third (the same history before
    each) give the same tokens and the same Step counts (tokens, drafted, accepted, depth per Step). A difference is
    nondeterminism (the wall clock, unseeded randomness, a race), shown with both outputs; what the first decode
    leaves behind for the next is the ``state`` check's."""
    st, cls = _st(), job.cls

    def body(prompt, T, kind, params):
        target, draft = pair("llama", kind, FLAT, job.precision)
        _record(build(cls, params, target, draft), prompt, T)  # the history both compared decodes share
        first = _record(build(cls, params, target, draft), prompt, T)
        second = _record(build(cls, params, target, draft), prompt, T)
        if first == second:
            return
        shown = {"prompt": prompt, "T": T, "draft": kind, "params": describe(params)}
        if first[0] != second[0]:
            i = next(
                (i for i, (a, b) in enumerate(zip(first[0], second[0])) if a != b), min(len(first[0]), len(second[0]))
            )
            raise CheckFailed(
                f"nondeterministic: the same prompt decoded twice differs at position {i}",
                {**shown, "position": i, "first": first[0], "second": second[0]},
            )
        i = next((i for i, (a, b) in enumerate(zip(first[1], second[1])) if a != b), min(len(first[1]), len(second[1])))
        raise CheckFailed(
            f"nondeterministic: the same tokens twice, but different Step counts from Step {i} "
            "(tokens, drafted, accepted, depth)",
            {**shown, "step": i, "first_steps": first[1], "second_steps": second[1]},
        )

    strategies = {"prompt": prompts(), "T": st.integers(1, 32), "kind": st.sampled_from(DRAFT_KINDS)}
    search(job.examples(4), {**strategies, "params": job.params(lambda p: None)}, body)


# --- length -----------------------------------------------------------------------------------------------------------


def length(job: Job) -> None:
    """Exactly T new tokens when EOS is not asked for: the Steps a decoder yields hold T tokens in all and then the
    generator ends (a decoder yielding more than asked fails with the prompt length and T, however the runner's cut
    at T would have hidden it); for a decoder that batches, every row of a B = 2..4 batch too."""
    st, cls = _st(), job.cls

    def body(prompt, T, arch, kind, sharpness, params):
        target, draft = pair(arch, kind, sharpness, job.precision)
        steps, ended = drive(build(cls, params, target, draft), prompt, T, stop_after=T)
        n = len(_tokens(steps))
        shown = {"prompt": prompt, "prompt_length": len(prompt), "T": T, "draft": kind, "params": describe(params)}
        last = {"last_step": {"tokens": list(steps[-1].tokens), "drafted": steps[-1].drafted}} if steps else {}
        if n > T:
            raise CheckFailed(
                f"yielded {n} tokens for T = {T} (prompt of {len(prompt)} tokens): {n - T} past T",
                {**shown, "produced": n, "steps": len(steps), **last},
            )
        if not ended:
            raise CheckFailed(f"yielded {len(steps)} Steps for T = {T} and did not end", {**shown, "produced": n})
        if n < T:
            raise CheckFailed(
                f"ended after {n} tokens of T = {T} (prompt of {len(prompt)} tokens, no EOS asked)",
                {**shown, "produced": n},
            )

    search(job.examples(12), pairs_space(job.params(lambda p: None)), body)
    batched = _batched_params(job)
    if batched is None:
        return

    def batch_body(rows, T, kind, params):
        target, draft = pair("llama", kind, FLAT, job.precision)
        out, ended = drive_rows(build(cls, params, target, draft), rows, T)
        shown = {"rows": rows, "T": T, "draft": kind, "params": describe(params)}
        for r, tokens in enumerate(out):
            if len(tokens) != T:
                what = f"{len(tokens) - T} past T" if len(tokens) > T else "short of T"
                raise CheckFailed(
                    f"row {r} of B = {len(rows)} got {len(tokens)} tokens for T = {T} "
                    f"(prompt of {len(rows[r])} tokens): {what}",
                    {**shown, "row": r, "produced": len(tokens)},
                )
        if not ended:
            raise CheckFailed(f"generate_batch at B = {len(rows)} did not end after T = {T} tokens a row", shown)

    search(
        job.examples(4),
        {
            "rows": distinct_rows(2, 4, 16),
            "T": st.integers(1, 24),
            "kind": st.sampled_from(DRAFT_KINDS),
            "params": batched,
        },
        batch_body,
    )


# --- eos --------------------------------------------------------------------------------------------------------------


def eos(job: Job) -> None:
    """With stopping at EOS asked (``eos_token_id`` set to a token the decoder emits without it), nothing after the
    first EOS it commits, in the same Step or a later one."""
    st, cls = _st(), job.cls

    def body(prompt, T, arch, kind, params, eos_at):
        target, draft = pair(arch, kind, FLAT, job.precision)
        free = collect(build(cls, params, target, draft), prompt, T)
        if not free:
            return
        stop = free[eos_at % len(free)]
        decoder = build(cls, params, target, draft)
        decoder.eos_token_id = stop
        steps, _ = drive(decoder, prompt, T, stop_after=T + 1)
        tokens = _tokens(steps)
        first = next((i for i, t in enumerate(tokens) if t in eos_ids(stop)), None)
        if first is not None and len(tokens) > first + 1:
            raise CheckFailed(
                f"committed {len(tokens) - first - 1} token(s) after the EOS ({stop}) at position {first}",
                {
                    "prompt": prompt,
                    "T": T,
                    "draft": kind,
                    "params": describe(params),
                    "eos": stop,
                    "position": first,
                    "after_eos": tokens[first + 1 : first + 9],
                },
            )

    strategies = {
        "prompt": prompts(),
        "T": st.integers(2, 40),
        "arch": st.sampled_from(ARCHS),
        "kind": st.sampled_from(DRAFT_KINDS),
        "params": job.params(lambda p: None),
        "eos_at": st.integers(0, 38),
    }
    search(job.examples(10), strategies, body)


# --- inputs_unchanged -------------------------------------------------------------------------------------------------


def inputs_unchanged(job: Job) -> None:
    """The caller's ``input_ids`` are the same after ``generate`` ran to T as before (values, shape, dtype, device);
    for a decoder that batches, every row's prompt tensor after ``generate_batch`` at B = 2..4 too."""
    st, cls = _st(), job.cls

    def check(before: list[torch.Tensor], after: list[torch.Tensor], shown: dict[str, Any]) -> None:
        for r, (b, a) in enumerate(zip(before, after)):
            same = a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
            if not same:
                where = "" if len(before) == 1 else f"row {r}'s "
                raise CheckFailed(
                    f"wrote into the caller's {where}input_ids: {b.tolist()[0][:16]} became {a.tolist()[0][:16]}",
                    {**shown, **({} if len(before) == 1 else {"row": r})},
                )

    def body(prompt, T, kind, params):
        target, draft = pair("llama", kind, FLAT, job.precision)
        decoder = build(cls, params, target, draft)
        ids = torch.tensor([prompt], device=device_of(decoder))
        before = ids.clone()
        gen: Any = decoder.generate(ids, T)
        n = 0
        try:
            for step in gen:
                n += len(step.tokens)
                if n >= T:
                    break
        finally:
            gen.close()
        check([before], [ids], {"prompt": prompt, "T": T, "draft": kind, "params": describe(params)})

    strategies = {"prompt": prompts(), "T": st.integers(1, 24), "kind": st.sampled_from(DRAFT_KINDS)}
    search(job.examples(6), {**strategies, "params": job.params(lambda p: None)}, body)
    batched = _batched_params(job)
    if batched is None:
        return

    def batch_body(rows, T, params):
        target, draft = pair("llama", "perturbed", FLAT, job.precision)
        decoder = build(cls, params, target, draft)
        inputs = [torch.tensor([p], device=device_of(decoder)) for p in rows]
        before = [t.clone() for t in inputs]
        done = [0] * len(rows)
        gen: Any = decoder.generate_batch(inputs, T)
        try:
            for step_of in gen:
                for r, step in step_of.items():
                    done[r] += len(step.tokens)
                if min(done) >= T:
                    break
        finally:
            gen.close()
        check(before, inputs, {"rows": rows, "T": T, "params": describe(params)})

    search(job.examples(3), {"rows": distinct_rows(2, 4, 16), "T": st.integers(1, 16), "params": batched}, batch_body)
