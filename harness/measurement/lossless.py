"""The lossless check: is every token a greedy decoder emitted the target's greedy choice, and is a divergence from
the reference a numeric tie or a decoder bug? (docs/lossless.md; issue 20.)

A lossless decoder (``Decoder.lossless``, greedy decoding) must emit, at every position, the target's argmax given
the decoder's *own* prefix. In float32, and much more in bfloat16/float16, the target's logits at one position are
not one number: the reference decoder computes them incrementally (one token on a KV cache), a speculative decoder
inside a verification forward over n tokens, and the two reductions round differently. Where the top two logits are
closer than that noise, the argmax can flip (SpecInfer/EAGLE/Medusa users meet it as "not lossless in fp16").

:func:`check_output` runs after the timed region (the worker calls it from :func:`~dtbench.harness.measurement.local_measurer.measure_cell`):

1. **Teacher-forced pass.** One pass of the target over prompt + output, chunked (:data:`CHUNK` output tokens per
   forward on the KV cache, the verification shape), gives the target's argmax at every output position given the
   decoder's own prefix. Every position is checked (``checked`` = T).
2. **Diagnosis** of each *flagged* position: one whose emitted token is not that argmax, and the first divergence
   from the reference's output. The target's next-token logits at that position are computed twice from the
   prefix: *incrementally* (the prefix minus its last token in one forward, then the last token alone on the KV
   cache: the reference's shape) and in *one forward over the prefix* (the verification shape). Recorded
   (:class:`Diagnosis`): top-1 and top-2 logits of each, both argmaxes, the noise ``max |incremental - full|``
   over the vocabulary, and the emitted token's margin.
3. **The rule** (:func:`classify`). With ``e`` the emitted token, ``inc``/``full`` the two logit vectors (float64),
   ``noise = max_v |inc[v] - full[v]|`` and ``margin = max(inc) - inc[e]`` (>= 0; it is the top-1/top-2 margin
   when ``e`` is the runner-up):

   - ``ok``: ``e`` is the argmax of both computations;
   - ``tie``: ``e`` is the argmax of exactly one of them (the two shapes disagree), or ``margin <= noise`` (``e``
     is within the measured numeric noise of the top logit; an exact tie has margin 0);
   - ``error``: otherwise — no computation of the target picks ``e`` and its logit is further below the top than
     the noise can explain. That is a decoder bug.

   A flagged position is never ``ok``: when both shapes pick ``e``, a third computation of the target disagreed
   (the chunked teacher-forced pass, or the reference's own incremental cache at its first divergence), so it is
   counted as a ``tie`` with margin ``max(chunked) - chunked[e]`` (at the first divergence from the reference:
   ``|inc[e] - inc[reference token]|``).

   Only the first :data:`DIAGNOSE_LIMIT` flagged positions of a sample are diagnosed with the two extra forwards;
   later ones use the teacher-forced logits alone (margin = top-1 - emitted logit there) against the largest noise
   measured in the sample so far (0 if none): a decoder that far off is in error anyway.

At batch size B > 1 (issue 29) the check runs per row, against the reference's same row; a flagged position is also
computed in the *batched shape* (:func:`batched_shape`: the row's prefix inside a right-padded batch beside the other
rows' prompts), a third computation the rule counts: a flip that the batch's numerics explain is a tie, a token no
shape picks (and further below the top than their noise) is an error in that row.

Verdicts (suite key ``lossless_check``): ``tie_aware`` (default) passes a sample with ``errors == 0``, ties allowed;
``exact`` is the token-for-token rule (output equal to the reference's). The counts are computed and stored under
both rules.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dtbench.decoders import kv
from dtbench.harness.values import first_divergence

RULES = ("exact", "tie_aware")
DEFAULT_RULE = "tie_aware"
CHUNK = 64  # output tokens per teacher-forced forward (bounds the logits held at once: CHUNK x vocab)
DIAGNOSE_LIMIT = 16  # flagged positions per sample diagnosed with the two computation shapes
KEEP_DIAGNOSES = 20  # diagnoses stored per sample (the first ones)


@dataclass
class Diagnosis:
    """One flagged position of an output, diagnosed (the fields of this module's docstring, step 2).

    Attributes:
        position: index in the output (0 = the first new token).
        emitted: the decoder's token there; reference: the reference's token when this is the first divergence.
        kind: ``tie`` or ``error`` (see :func:`classify`).
        incremental_argmax, full_argmax: the argmax of each computation (None when not diagnosed: past the limit).
        incremental_top, full_top: (top-1, top-2) logits of each computation.
        noise: max |incremental - full| over the vocabulary (logit units); margin: see :func:`classify`.
    """

    position: int
    emitted: int
    kind: str
    margin: float
    noise: float
    incremental_argmax: int | None = None
    full_argmax: int | None = None
    incremental_top: tuple[float, float] | None = None
    full_top: tuple[float, float] | None = None
    reference: int | None = None


@dataclass
class Check:
    """The check of one output (stored in the ``samples.lossless_*`` columns, see :meth:`columns`).

    Attributes:
        checked: output positions checked (T); ties, errors: flagged positions classified so.
        first_error: output position of the first error, error_margin its margin (logits).
        max_tie_margin: the largest margin among ties (logits; None without ties); max_noise: the largest noise
            measured at a diagnosed position.
        seconds: wall time of the check (outside the timed region).
        diagnoses: the first :data:`KEEP_DIAGNOSES` :class:`Diagnosis` records.
    """

    checked: int = 0
    ties: int = 0
    errors: int = 0
    first_error: int | None = None
    error_margin: float | None = None
    max_tie_margin: float | None = None
    max_noise: float | None = None
    seconds: float = 0.0
    diagnoses: list[Diagnosis] = field(default_factory=list)

    def add(self, d: Diagnosis) -> None:
        if d.kind == "tie":
            self.ties += 1
            self.max_tie_margin = d.margin if self.max_tie_margin is None else max(self.max_tie_margin, d.margin)
        elif d.kind == "error":
            self.errors += 1
            if self.first_error is None or d.position < self.first_error:
                self.first_error, self.error_margin = d.position, d.margin
        if d.incremental_argmax is not None:
            self.max_noise = d.noise if self.max_noise is None else max(self.max_noise, d.noise)
        if len(self.diagnoses) < KEEP_DIAGNOSES:
            self.diagnoses.append(d)

    def columns(self) -> dict[str, Any]:
        """The ``samples`` columns of this check (plain JSON-able values)."""
        return dict(
            lossless_checked=self.checked,
            lossless_ties=self.ties,
            lossless_errors=self.errors,
            lossless_first_error=self.first_error,
            lossless_error_margin=self.error_margin,
            lossless_tie_margin=self.max_tie_margin,
            lossless_noise=self.max_noise,
            lossless_check_s=self.seconds,
            lossless_diagnoses=[asdict(d) for d in self.diagnoses],
        )


def classify(
    emitted: int, incremental: torch.Tensor, full: torch.Tensor, *others: torch.Tensor
) -> tuple[str, float, float]:
    """The tie rule at one position: ``(kind, margin, noise)`` (this module's docstring, step 3).

    Args:
        emitted: the decoder's token id.
        incremental, full: the target's next-token logits at that position from the two computation shapes,
            shape (vocab,), any float dtype (compared in float64).
        others: more computation shapes of the same logits (a batched row's: the position computed inside a padded
            batch, :func:`batched_shape`); each counts like ``full``.

    Returns:
        kind: ``ok`` (argmax of every shape), ``tie`` (argmax of some, or ``margin <= noise``) or ``error``;
        margin = max(incremental) - incremental[emitted] (>= 0, logits); noise = max over the other shapes of
        max |incremental - shape|.
    """
    inc = incremental.double()
    shapes = [full.double(), *(o.double() for o in others)]
    noise = max(float((inc - sh).abs().max()) for sh in shapes)
    margin = float(inc.max() - inc[emitted])
    picks = (int(inc.argmax()) == emitted) + sum(int(sh.argmax()) == emitted for sh in shapes)
    if picks == 1 + len(shapes):
        return "ok", margin, noise
    return tie_or_error(margin, noise, picked=picks >= 1), margin, noise


def tie_or_error(margin: float | None, noise: float, *, tolerance: float | None = None, picked: bool = False) -> str:
    """The one tie rule at a flagged position (a token that is not the target's, or the reference's, choice): of
    this module's check (:func:`classify`, and the positions past :data:`DIAGNOSE_LIMIT`) and of a server's output
    check (:func:`dtbench.harness.serving.check.check_request`, top log-probabilities instead of logits).

    Args:
        margin: how far the emitted token lies below the compared one (logits, or log-probabilities; >= 0), None
            when unknown (it is not among a server's top candidates).
        noise: the largest disagreement measured between two computation shapes of the same position (>= 0).
        tolerance: a floor of the allowed margin (a server's ``tie_margin``); None: the noise alone.
        picked: some computation shape picks the emitted token.

    Returns:
        ``tie`` when ``picked`` or ``margin <= max(tolerance, noise)``, else ``error`` (an unknown margin is an error).
    """
    limit = noise if tolerance is None else max(tolerance, noise)
    return "tie" if picked or (margin is not None and margin <= limit) else "error"


def batched_shape(model: torch.nn.Module, prefix: list[int], companions: list[list[int]]) -> torch.Tensor:
    """The target's next-token logits after ``prefix`` computed as one row of a right-padded batch beside
    ``companions`` (the other rows' prompts): the batched shape of a row decoded at batch size B > 1
    (:class:`~dtbench.decoders.kv.RaggedBatch`), whose reductions round differently from batch 1. Shape (vocab,)."""
    with torch.inference_mode():
        return kv.RaggedBatch(model).prefill([list(prefix), *[list(c) for c in companions]])[0]


def _top2(logits: torch.Tensor) -> tuple[float, float]:
    vals = logits.double().topk(2).values
    return float(vals[0]), float(vals[1])


def two_shapes(model: torch.nn.Module, prefix: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's next-token logits after ``prefix``, computed incrementally and in one forward.

    Args:
        model: the target (a transformers causal LM); prefix: prompt + output tokens before the position (>= 1).

    Returns:
        (incremental, full), each shape (vocab,) in the model's dtype: ``incremental`` from a forward over
        ``prefix[:-1]`` followed by ``prefix[-1]`` alone on its KV cache (the reference's one-token shape; with a
        one-token prefix it is a single forward), ``full`` from one forward over the whole prefix (the verification
        shape, logits of its last position).
    """
    ids = torch.tensor([prefix], dtype=torch.long, device=device)
    cache = kv.new_cache()
    if len(prefix) > 1:
        kv.forward(model, ids[:, :-1], cache, last_only=True)
    incremental = kv.forward(model, ids[:, -1:], cache)[-1]
    full = kv.forward(model, ids, kv.new_cache(), last_only=True)[-1]
    return incremental, full


def teacher_forced(
    model: torch.nn.Module, prompt: list[int], output: list[int], device, chunk: int = CHUNK
) -> tuple[list[int], list[float]]:
    """The target's greedy choice at every output position given the output's own prefix (the verification shape).

    Args:
        model: the target; prompt: its token ids (>= 1); output: the decoder's T new tokens.
        chunk: output tokens fed per forward on the KV cache (memory: chunk x vocab logits at once).

    Returns:
        (argmax, margin): per output position, the argmax of the target's logits there and ``max - logit[emitted]``
        (>= 0; logits, float64).
    """
    argmax: list[int] = []
    margin: list[float] = []
    if not output:
        return argmax, margin
    cache = kv.new_cache()
    ids = torch.tensor([list(prompt) + list(output[:-1])], dtype=torch.long, device=device)
    logits = kv.forward(model, ids[:, : len(prompt)], cache, last_only=True)  # predicts output[0]
    while True:
        start = len(argmax)  # the output position the first row of ``logits`` predicts
        rows = logits.double()
        targets = torch.tensor(output[start : start + rows.shape[0]], device=rows.device)
        argmax.extend(int(a) for a in rows.argmax(-1))
        margin.extend(float(m) for m in rows.max(-1).values - rows.gather(-1, targets[:, None])[:, 0])
        if len(argmax) >= len(output):
            break
        fed = len(prompt) + len(argmax) - 1  # tokens in the cache: the prompt and output[:len(argmax) - 1]
        logits = kv.forward(model, ids[:, fed : fed + chunk], cache)  # row j predicts output[len(argmax) + j]
    return argmax[: len(output)], margin[: len(output)]


def check_output(
    model: torch.nn.Module,
    prompt: list[int],
    output: list[int],
    reference: list[int] | None,
    device,
    *,
    chunk: int = CHUNK,
    companions: list[list[int]] | None = None,
) -> Check:
    """Check every emitted token of ``output`` against the target and diagnose every flagged position.

    Args:
        model: the target (a transformers causal LM, any dtype; eval mode), on ``device``.
        prompt: the prompt token ids (>= 1); output: the decoder's T new tokens.
        reference: the reference decoder's output on the same prompt (its first divergence is diagnosed), or None.
        chunk: see :func:`teacher_forced`.
        companions: a row decoded at batch size B > 1: the other rows' prompts; each flagged position is then also
            computed in the batched shape (:func:`batched_shape`), a third computation the tie rule counts, so a
            difference the batch's numerics explain is a tie and anything else an error in this row.

    Returns:
        a :class:`Check` (counts, first error, largest tie margin, diagnoses, seconds spent).
    """
    start = time.perf_counter()
    check = Check(checked=len(output))
    with torch.inference_mode():
        argmax, tf_margin = teacher_forced(model, prompt, output, device, chunk)
        diverged = first_divergence(output, reference) if reference is not None else None
        flagged = sorted(
            {i for i, (a, t) in enumerate(zip(argmax, output)) if a != t}
            | ({diverged} if diverged is not None and diverged < len(output) else set())
        )
        for n, i in enumerate(flagged):
            e = int(output[i])
            if n >= DIAGNOSE_LIMIT:
                noise = check.max_noise or 0.0
                check.add(Diagnosis(i, e, tie_or_error(tf_margin[i], noise), tf_margin[i], noise))
                continue
            inc, full = two_shapes(model, list(prompt) + list(output[:i]), device)
            extra = [batched_shape(model, list(prompt) + list(output[:i]), companions)] if companions else []
            kind, margin, noise = classify(e, inc, full, *extra)
            ref = int(reference[i]) if i == diverged and reference is not None and i < len(reference) else None
            if kind == "ok":  # both shapes pick e, but the chunked pass (or the reference's cache) picked another
                kind = "tie"
                margin = abs(float(inc.double()[e] - inc.double()[ref])) if ref is not None else tf_margin[i]
            check.add(
                Diagnosis(
                    i, e, kind, margin, noise, int(inc.argmax()), int(full.argmax()), _top2(inc), _top2(full), ref
                )
            )
    check.seconds = time.perf_counter() - start
    return check


def verdict(rule: str, check: Check | None, first_divergence: int | None, has_reference: bool) -> bool | None:
    """A sample's ``lossless`` value under ``rule``.

    ``exact``: output equal to the reference's (None for a reference itself, which has nothing to equal).
    ``tie_aware``: no error among the checked positions (references included: they are checked against the target
    too); None when the output was not checked.

    Raises:
        ValueError: an unknown rule.
    """
    if rule == "exact":
        return (first_divergence is None) if has_reference else None
    if rule == "tie_aware":
        return None if check is None else check.errors == 0
    raise ValueError(f"unknown lossless_check rule {rule!r} (choose {' or '.join(RULES)})")


def sample_columns(
    model: torch.nn.Module,
    prompt: list[int],
    row: dict[str, Any],
    reference: list[int] | None,
    device,
    rule: str,
    companions: list[list[int]] | None = None,
) -> dict[str, Any]:
    """The ``samples`` columns the check adds to a greedy lossless decoder's row (the runner's one hook).

    Args:
        model: the target; prompt: the prompt's token ids; row: the row of :func:`~dtbench.harness.measurement.observation.sample_row`
            (its ``output_tokens`` and ``first_divergence`` are read).
        reference: the reference's output on the prompt (None: the sample is a reference, or is not compared).
        rule: the suite's ``lossless_check`` (:data:`RULES`).
        companions: the other rows' prompts when the row was decoded in a batch (:func:`check_output`).

    Returns:
        the ``lossless_*`` columns of :meth:`Check.columns` and ``lossless`` under ``rule`` (:func:`verdict`).
    """
    check = check_output(model, list(prompt), list(row["output_tokens"]), reference, device, companions=companions)
    return {**check.columns(), "lossless": verdict(rule, check, row["first_divergence"], reference is not None)}
