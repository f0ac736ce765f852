"""What the conformance checks share (issue 56; the checks: :mod:`dtbench.testing.checks`, the public kit:
:mod:`dtbench.testing`): precisions, the seeded tiny model pairs, the context a decoder draws its settings from, the
collection of a decoder's tokens as the runner cuts them, the reference output and the hypothesis search that turns
a failing example into one counterexample.

Modelled on scikit-learn's ``check_estimator`` (named checks, applicability from what the object declares) and
PyTorch's OpInfo (one declaration per decoder, every property derived from it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from dtbench.core import DtbenchError
from dtbench.decoders.base import Decoder, DecoderParams, eos_ids
from dtbench.decoders.cut import cut_tokens
from dtbench.testing.context import CheckContext as CheckContext  # re-exported: the kit's names stay here
from dtbench.testing.context import scratch_root as scratch_root
from dtbench.testing.fixtures import FLAT, SHARP, VOCAB, perturbed, tiny_model

EXAMPLES_ENV = "DTBENCH_HYPOTHESIS_EXAMPLES"  # caps every check's hypothesis examples (the GPU check's tests step)
DRAFT_KINDS = ("self", "perturbed", "unrelated")  # accepts everything, some, almost nothing


class CheckFailed(AssertionError):
    """A check found a defect: ``message`` is the one-line verdict's reason, ``counterexample`` the inputs that show
    it (prompt ids, params, T, first differing position, both tokens, ...)."""

    def __init__(self, message: str, counterexample: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        self.counterexample = counterexample or {}


class NotApplicable(Exception):  # noqa: N818 (a verdict, not an error)
    """The check does not apply to this decoder (the reason names the declaration, never the decoder's name)."""


# --- precisions -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """Where and how a check runs: ``device`` ("cpu"/"cuda"), ``dtype``, ``rule`` ("exact": token for token;
    "tie_aware": harness/measurement/lossless.py's rule, numeric near ties of the target's argmax allowed)."""

    name: str
    device: str
    dtype: torch.dtype
    rule: str


PRECISIONS = {
    "cpu": Precision("cpu", "cpu", torch.float64, "exact"),
    "cpu-bfloat16": Precision("cpu-bfloat16", "cpu", torch.bfloat16, "tie_aware"),
    "cuda": Precision("cuda", "cuda", torch.float32, "exact"),
    "cuda-float16": Precision("cuda-float16", "cuda", torch.float16, "tie_aware"),
}


def precisions(spec: str) -> list[Precision]:
    """The precisions of ``--device``: ``auto`` (cpu, and cuda + cuda-float16 when a GPU is visible), ``cpu``, ``cuda``
    (float32 exact and float16 tie-aware), or a comma list of :data:`PRECISIONS` names.

    Raises:
        DtbenchError: an unknown name, or CUDA asked for without a GPU.
    """
    has_cuda = torch.cuda.is_available()
    if spec == "auto":
        names = ["cpu", "cuda", "cuda-float16"] if has_cuda else ["cpu"]
    elif spec == "cuda":
        names = ["cuda", "cuda-float16"]
    else:
        names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRECISIONS]
    if unknown or not names:
        raise DtbenchError(f"unknown device {', '.join(unknown) or repr(spec)}: use auto, {', '.join(PRECISIONS)}")
    if any(PRECISIONS[n].device == "cuda" for n in names) and not has_cuda:
        raise DtbenchError("--device asks for CUDA, and no CUDA GPU is visible (torch.cuda.is_available() is False)")
    return [PRECISIONS[n] for n in names]


def examples(default: int, asked: int | None = None) -> int:
    """Hypothesis examples of a check: ``asked`` (``--examples``) or the check's default, capped by
    ``$DTBENCH_HYPOTHESIS_EXAMPLES``."""
    n = asked if asked is not None else default
    cap = os.environ.get(EXAMPLES_ENV, "")
    return max(1, min(n, int(cap))) if cap.isdigit() and int(cap) > 0 else max(1, n)


# --- models -------------------------------------------------------------------------------------------------------------


@cache
def pair(arch: str, kind: str, sharpness: float, precision: Precision) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(target, draft) of the seeded tiny models (:mod:`dtbench.testing.fixtures`, vocabulary 96) on the precision's
    device and dtype: the draft the target itself (``self``), a perturbed copy (``perturbed``) or an unrelated model
    (``unrelated``). Cached: the same objects for the same arguments, in every check of a process."""
    target = _base(arch, sharpness)
    if kind == "self":
        draft = target
    elif kind == "perturbed":
        draft = _perturbed(arch, sharpness)
    else:
        draft = tiny_model(arch, 7, sharpness=sharpness)
    return _on(target, precision), _on(draft, precision)


@cache
def _base(arch: str, sharpness: float) -> torch.nn.Module:
    return tiny_model(arch, 0, sharpness=sharpness)


@cache
def _perturbed(arch: str, sharpness: float) -> torch.nn.Module:
    return perturbed(_base(arch, sharpness), 0.005, seed=1)


@cache
def _on(model: torch.nn.Module, precision: Precision) -> torch.nn.Module:
    if precision.device == "cpu" and precision.dtype == torch.float64:
        return model
    import copy

    return copy.deepcopy(model).to(device=precision.device, dtype=precision.dtype).eval()


SHARPNESS = (FLAT, SHARP)
ARCHS = ("llama", "neox")


# --- the context a decoder draws its settings from --------------------------------------------------------------------


def settings_of(cls: type[Decoder[Any]], ctx: CheckContext) -> list[DecoderParams] | Any:
    """The decoder's declared settings for ``ctx``: validated params instances, or a hypothesis strategy of them.

    Raises:
        CheckFailed: a declared setting is not valid params (the declaration itself is the defect).
    """
    declared = cls.check_settings(ctx)
    if isinstance(declared, list | tuple):
        out = []
        for params in declared:
            try:
                out.append(params if isinstance(params, DecoderParams) else cls.Params(**params))
            except Exception as exc:  # pydantic's ValidationError: a one-line reason
                raise CheckFailed(f"declared setting {params} is invalid: {str(exc).splitlines()[0]}") from None
        return out
    return declared.map(lambda p: p if isinstance(p, DecoderParams) else cls.Params(**p))


def build(cls: type[Decoder[Any]], params: DecoderParams, target: torch.nn.Module, draft: torch.nn.Module | None):
    """A decoder bound to the pair, as the runner builds it (the draft only when it needs one)."""
    return cls(target, draft if cls.needs_draft else None, params)


def describe(params: DecoderParams) -> dict[str, Any]:
    """The params a counterexample shows: the fields set explicitly (paths shortened to their name)."""
    out = {}
    for key, value in params.model_dump(exclude_unset=True).items():
        out[key] = Path(value).name if isinstance(value, str) and os.sep in value else value
    return out


# --- tokens as the runner cuts them ---------------------------------------------------------------------------------


def collect(decoder: Decoder[Any], prompt: list[int], T: int) -> list[int]:
    """The decoder's committed tokens on ``prompt`` (``generate``), cut as the runner cuts them; iteration stops once
    T tokens or an EOS are committed (:func:`~dtbench.decoders.cut.cut_tokens`, the runner's one cut). Empty Steps are
    tolerated here (the ``step_accounting`` check judges them)."""
    eos = eos_ids(decoder.eos_token_id)
    tokens: list[int] = []
    device = device_of(decoder)
    gen: Any = decoder.generate(torch.tensor([prompt], device=device), T)
    try:
        for step in gen:
            tokens.extend(int(t) for t in step.tokens)
            if len(tokens) >= T or eos.intersection(step.tokens):
                break
    finally:
        gen.close()
    return cut_tokens(tokens, T, eos)


def collect_rows(decoder: Decoder[Any], prompts: list[list[int]], T: int) -> list[list[int]]:
    """Each row's committed tokens at B = len(prompts) (``generate_batch``), cut as the runner cuts them."""
    eos = eos_ids(decoder.eos_token_id)
    rows: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    device = device_of(decoder)
    gen: Any = decoder.generate_batch([torch.tensor([p], device=device) for p in prompts], T)
    try:
        for out in gen:
            for r, step in out.items():
                if not done[r]:
                    rows[r].extend(int(t) for t in step.tokens)
                    done[r] = len(rows[r]) >= T or bool(eos.intersection(step.tokens))
            if all(done):
                break
    finally:
        gen.close()
    return [cut_tokens(r, T, eos) for r in rows]


def device_of(decoder: Decoder[Any]) -> torch.device:
    """The device of the decoder's target (a transformers model's ``device``)."""
    return torch.device(getattr(decoder.target, "device", "cpu"))


@torch.inference_mode()
def greedy(target: Any, prompt: list[int], T: int, eos: frozenset[int]) -> list[int]:
    """The target's greedy continuation computed from scratch at every position (no KV cache, nothing of dtbench's
    loops): the independent ground truth of a decoder whose reference is ``ar``."""
    ids = torch.tensor([prompt], device=target.device)
    out: list[int] = []
    for _ in range(T):
        token = int(torch.argmax(target(input_ids=ids).logits[0, -1]).item())
        out.append(token)
        if token in eos:
            break
        ids = torch.cat([ids, torch.tensor([[token]], device=ids.device)], dim=1)
    return out


def reference_tokens(
    cls: type[Decoder[Any]], params: DecoderParams, target, draft, prompt: list[int], T: int, eos: frozenset[int]
) -> list[int]:
    """What the decoder's output must equal: the target's greedy tokens (:func:`greedy`) when its reference is
    ``ar`` (or it has none), else the named reference decoder's output (``Decoder.reference``)."""
    ref = cls.reference(params)
    if ref is None or (ref[0] == "ar" and not ref[1]):
        return greedy(target, prompt, T, eos)
    from dtbench.harness import registry

    ref_cls = registry.get(ref[0])
    decoder = build(ref_cls, ref_cls.Params(**ref[1]), target, draft)
    decoder.eos_token_id = tuple(eos) or None
    return collect(decoder, prompt, T)


def first_difference(output: list[int], expected: list[int]) -> dict[str, Any]:
    """{position, expected, got} of the first position where ``output`` and ``expected`` differ (a missing token
    is None)."""
    for i in range(max(len(output), len(expected))):
        a = output[i] if i < len(output) else None
        b = expected[i] if i < len(expected) else None
        if a != b:
            return {"position": i, "expected": b, "got": a}
    return {}


def compare(precision: Precision, target, prompt, output, expected, companions=None) -> dict[str, Any] | None:
    """None when ``output`` passes against ``expected`` under the precision's rule, else the difference."""
    if output == expected:
        return None
    if precision.rule == "exact":
        return first_difference(output, expected)
    from dtbench.harness.measurement.lossless import check_output

    check = check_output(target, prompt, output, expected, target.device, companions=companions)
    if check.errors == 0 and len(output) == len(expected):
        return None
    return {**first_difference(output, expected), "errors": check.errors, "first_error": check.first_error}


# --- the search ---------------------------------------------------------------------------------------------------------


SHRINK_ENV = "DTBENCH_CHECK_SHRINK"  # "1": shrink a failing example to a minimal one (slower: minutes per failure)


@dataclass
class SearchStats:
    """What one :func:`search` did: ``examples`` run (the shrinker's tries included), ``shrinks`` (tries after the
    first failure), ``out_of_time`` (the deadline cut it: examples after it were not run)."""

    examples: int = 0
    shrinks: int = 0
    out_of_time: bool = False


def search(
    n: int,
    strategies: dict[str, Any],
    body: Callable[..., None],
    *,
    shrink: bool | None = None,
    deadline: float | None = None,
    size: Callable[[dict[str, Any]], int] | None = None,
    at_least: int = 0,
) -> SearchStats:
    """Run ``body`` on ``n`` hypothesis examples drawn from ``strategies`` (derandomized: the same examples every
    run); the first failing example's :class:`CheckFailed` is re-raised (other exceptions become one).

    Hypothesis generates small examples first, so the first failure is usually small already; shrinking it further
    reruns the body hundreds of times (4 minutes for one planted state leak on a 2-core CPU, against 4 seconds
    without), so for a decoder it is opt-in (``$DTBENCH_CHECK_SHRINK=1``, or ``shrink``).

    Args:
        shrink: shrink a failing example (None: ``$DTBENCH_CHECK_SHRINK``).
        deadline: ``time.monotonic()`` after which no example runs (each is rejected at once, so the generation and
            the shrinking end); with it, the smallest failure seen is raised, whatever hypothesis ends with.
        size: an example's size (the server kit: its prompt's tokens); the failure raised is the smallest by it,
            its counterexample carrying ``shrunk``: {``from_size``, ``to_size``, ``tries``}.
        at_least: the first ``at_least`` examples run even past ``deadline`` (the server kit asks 1: every check
            a verdict, however little budget is left).

    Returns:
        The :class:`SearchStats` of a search that found no failure.
    """
    import time

    from hypothesis import HealthCheck, Phase, given, reject, settings

    stats = SearchStats()
    failures: list[tuple[int, int, CheckFailed]] = []  # (size, order, failure)

    def guarded(**kw: Any) -> None:
        if deadline is not None and stats.examples >= at_least and time.monotonic() > deadline:
            stats.out_of_time = True
            reject()
        stats.examples += 1
        stats.shrinks += bool(failures)
        try:
            body(**kw)
        except NotApplicable:
            raise
        except CheckFailed as exc:
            failures.append((size(kw) if size else 0, len(failures), exc))
            raise
        except Exception as exc:  # a crash is a finding: the inputs that make the decoder raise
            from hypothesis.errors import HypothesisException

            if isinstance(exc, HypothesisException):
                raise
            detail = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            failure = CheckFailed(f"raised {detail}", _shown(kw))
            failures.append((size(kw) if size else 0, len(failures), failure))
            raise failure from exc

    shrinking = os.environ.get(SHRINK_ENV) == "1" if shrink is None else shrink
    test = settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        report_multiple_bugs=False,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
        phases=tuple(Phase) if shrinking else tuple(p for p in Phase if p != Phase.shrink),
    )(given(**strategies)(guarded))
    from hypothesis.errors import Flaky, Unsatisfiable

    try:
        test()
    except NotApplicable:
        raise
    except Unsatisfiable:  # every example rejected: the deadline came before the first
        if not failures:
            return stats
    except Flaky as exc:  # failed once, passed when replayed: state the first run left (a first compile, a cache)
        inner = [e for e in getattr(exc, "exceptions", ()) if isinstance(e, CheckFailed)]
        if size is not None and failures and stats.out_of_time:  # the replay came after the deadline: not flaky
            raise _smallest(failures, stats) from None
        if not inner:
            raise CheckFailed(
                f"fails only on a first run (not reproducible on replay): {str(exc).splitlines()[0]}"
            ) from exc
        raise CheckFailed(
            f"{inner[0].message} (on the first run only: replayed, it passed)", inner[0].counterexample
        ) from exc
    except CheckFailed:
        if size is None:
            raise
    if failures:
        if size is None:
            raise failures[0][2]
        raise _smallest(failures, stats)
    return stats


def _smallest(failures: list[tuple[int, int, CheckFailed]], stats: SearchStats) -> CheckFailed:
    """The smallest failure (the first of that size), its counterexample saying how far it shrank."""
    best = min(failures, key=lambda f: (f[0], f[1]))[2]
    best.counterexample = {
        **best.counterexample,
        "shrunk": {"from_size": failures[0][0], "to_size": min(f[0] for f in failures), "tries": stats.shrinks},
    }
    return best


def _shown(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: describe(v) if isinstance(v, DecoderParams) else v for k, v in kw.items()}


def prompts(min_size: int = 1, max_size: int = 24) -> Any:
    """Prompt ids of the tiny vocabulary (3..95: no BOS/EOS/pad)."""
    from hypothesis import strategies as st

    return st.lists(st.integers(3, VOCAB - 1), min_size=min_size, max_size=max_size)


def pairs_space(params: Any, max_T: int = 40) -> dict[str, Any]:
    """The strategies of a check over every tiny pair: ``prompt``, ``T`` (1..``max_T``), ``arch`` (Llama, GPT-NeoX),
    ``kind`` (draft = target, perturbed, unrelated), ``sharpness`` (flat, sharp) and ``params`` (the strategy given)."""
    from hypothesis import strategies as st

    return {
        "prompt": prompts(),
        "T": st.integers(1, max_T),
        "arch": st.sampled_from(ARCHS),
        "kind": st.sampled_from(DRAFT_KINDS),
        "sharpness": st.sampled_from(SHARPNESS),
        "params": params,
    }


def distinct_rows(min_rows: int, max_rows: int, max_size: int, min_size: int = 1) -> Any:
    """B = ``min_rows``..``max_rows`` prompts of distinct lengths and distinct last tokens (ragged rows, no two alike:
    an example whose rows are identical cannot show a row swap, issue 65)."""
    from hypothesis import strategies as st

    def rows(b: int) -> Any:
        return st.lists(
            prompts(min_size, max_size),
            min_size=b,
            max_size=b,
            unique_by=(len, lambda p: p[-1]),
        )

    return st.integers(min_rows, max_rows).flatmap(rows)


def iter_params(settings: Any, keep: Callable[[DecoderParams], str | None]) -> Iterator[DecoderParams]:
    """The declared settings (a list) that ``keep`` has no reason against."""
    for params in settings:
        if keep(params) is None:
            yield params


def resolve(decoder: str | type) -> tuple[str, type[Decoder[Any]]]:
    """(name, class) of a registered decoder name or a Decoder subclass.

    Raises:
        DtbenchError: an unknown name (the registry's one-line message), or a class that is not a Decoder.
    """
    from dtbench.harness import registry

    if isinstance(decoder, str):
        return decoder, registry.get(decoder)
    if isinstance(decoder, type) and issubclass(decoder, Decoder):
        return decoder.__name__, decoder
    raise DtbenchError(f"not a decoder: {decoder!r} (give a registered name or a Decoder subclass)")
