"""The conformance kit's ``sampling`` check (issue 56): a sampled decoder's outputs follow the target's distribution.

On a tiny float64 Llama with a 6-token vocabulary, the exact law of the first M = 3 generated tokens under the
target (temperature, top-k, top-p in transformers' order: :class:`~dtbench.decoders.sampling.SamplingSettings`) is
computed by enumeration; the decoder generates RUNS times with independently seeded generators and a chi-square test
compares the counts (bins expecting fewer than 5 merged). An exact decoder fails with probability ALPHA per setting.
Each generation asks for LENGTH = 7 tokens and stops at the step that completes its first M: at T = M a chain's first
iteration could draft one token only (its drafts are capped by what is left of T), so a wrong rule for a second or
later drafted token went unseen (issue 57's review); later steps draw after the first M tokens and cannot change them.
The draft is a perturbed copy of the target (noise 0.3: drafts accepted and rejected). A decoder that declares
``batch_sampling`` has one of its laws drawn as the rows of batched generations (:func:`legs_of`), so its
``generate_batch`` sampling is checked too. The law is enumerated in
float64 on the CPU, so the check runs at the ``cpu`` precision only (another precision's id says not applicable). Lossless speculative sampling:
Leviathan et al. 2023, Algorithm 1; tree decoders: SpecInfer (Miao et al. 2024), multi-draft recursive rejection.
"""

from __future__ import annotations

import copy
import itertools
from functools import cache
from typing import Any

import torch

from dtbench.testing.common import CheckContext, CheckFailed, NotApplicable, build, describe, settings_of

VOCAB, M, RUNS, ALPHA = 6, 3, 1000, 1e-4
LENGTH = 7  # tokens a generation asks for (its first M are counted): room to draft and verify several at once
PROMPT = [1, 4, 2, 5]
MAX_SETTINGS = 2  # declared settings tested per decoder (each costs RUNS generations)
ROWS = 250  # rows of one generate_batch call when a batched law is drawn (batch_sampling): RUNS / ROWS calls


def tiny(seed: int, sharpness: float = 2.0, layers: int = 1) -> torch.nn.Module:
    """A float64 Llama over a 6-token vocabulary (hidden 16, ``layers`` layers), lm_head scaled by ``sharpness``: the
    model whose sampled law is enumerable (tests/test_sampling.py uses it too)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model: Any = LlamaForCausalLM(cfg)
    model = model.to(torch.float64).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


@cache
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(target, draft): the 6-token target and a perturbed copy (partial acceptance)."""
    target = tiny(0)
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return target, draft


@torch.inference_mode()
def exact(settings: Any) -> dict[tuple[int, ...], float]:
    """P(x1..xM | PROMPT) under the target's processed distribution, by enumeration."""
    target = models()[0]
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=M):
        probs = settings.probs(target(input_ids=torch.tensor([PROMPT + list(seq[:-1])])).logits[0, len(PROMPT) - 1 :])
        out[seq] = float(torch.prod(torch.stack([probs[i, t] for i, t in enumerate(seq)])))
    return out


def draw(
    decoder: Any, settings: Any, runs: int = RUNS, length: int | None = None, rows: int = 1, prompt: list[int] = PROMPT
) -> dict[tuple[int, ...], int]:
    """Counts of the first M tokens of ``runs`` seeded generations of ``length`` tokens (default: the module's
    LENGTH, read at call time) from ``prompt``.

    ``rows = 1``: one :meth:`~dtbench.decoders.base.Decoder.generate` per run, its generator seeded by the run's
    index. ``rows > 1`` (a decoder declaring ``batch_sampling``): the runs drawn as the rows of ceil(runs / rows)
    :meth:`~dtbench.decoders.base.Decoder.generate_batch` calls, the rows of one call sharing a generator seeded by
    the call's index (each row an independent draw: the contract). A generation stops at the step that completes
    its first M tokens (a batch: once every row has them); later steps draw after them and cannot change them.
    """
    length = LENGTH if length is None else length
    counts: dict[tuple[int, ...], int] = {}
    for call in range(-(-runs // rows)):
        n = min(rows, runs - call * rows)
        decoder.sampling, decoder.generator = settings, torch.Generator().manual_seed(call)
        got: list[list[int]] = [[] for _ in range(n)]
        if rows == 1:
            steps: Any = ({0: step} for step in decoder.generate(torch.tensor([prompt]), length))
        else:
            steps = decoder.generate_batch([torch.tensor([prompt]) for _ in range(n)], length)
        for out in steps:
            for r, step in out.items():
                got[r].extend(step.tokens)
            if all(len(tokens) >= M for tokens in got):
                break
        getattr(steps, "close", lambda: None)()
        for tokens in got:
            counts[tuple(tokens[:M])] = counts.get(tuple(tokens[:M]), 0) + 1
    return counts


def p_value(decoder: Any, settings: Any, rows: int = 1) -> tuple[float, dict[tuple[int, ...], int]]:
    """(chi-square p-value of RUNS seeded generations (:func:`draw`, ``rows`` per generation) against
    :func:`exact`, the counts)."""
    from scipy import stats

    counts = draw(decoder, settings, rows=rows)
    probs = exact(settings)
    impossible = [k for k in counts if probs.get(k, 0.0) == 0.0]
    if impossible:
        return 0.0, counts
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for key, p in probs.items():
        if p * RUNS >= 5:
            observed.append(counts.get(key, 0))
            expected.append(p * RUNS)
        else:
            rest_o += counts.get(key, 0)
            rest_e += p * RUNS
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    scale = sum(observed) / sum(expected)
    return float(stats.chisquare(observed, [e * scale for e in expected]).pvalue), counts


def sampling(job: Any) -> None:
    """The ``sampling`` check of one decoder (see the module docstring)."""
    from dtbench.decoders.sampling import SamplingSettings

    cls = job.cls
    if not cls.supports_sampling:
        raise NotApplicable("declares supports_sampling = False")
    if job.precision.device != "cpu" or job.precision.dtype != torch.float64:
        raise NotApplicable("the sampled law is enumerated in float64 on the CPU: checked at the cpu precision")
    target, draft = models()
    declared = settings_of(cls, CheckContext(target))
    if not isinstance(declared, list):
        from hypothesis import find

        declared = [find(declared, lambda p: True)]
    usable = [p for p in declared if cls.sampling_error(p) is None and cls.lossless_with(p)]
    if not usable:
        reason = cls.sampling_error(declared[0]) if declared else None
        raise NotApplicable(reason or "no declared setting is lossless under sampling (lossless_with)")
    settings = SamplingSettings(temperature=1.0)
    legs = legs_of(cls, usable[:MAX_SETTINGS])
    for params, rows in legs:
        p, counts = p_value(build(cls, params, target, draft), settings, rows)
        if p <= ALPHA:
            probs = exact(settings)
            worst = max(counts, key=lambda k: counts[k] - probs.get(k, 0.0) * RUNS)
            at = f" at B = {rows} (generate_batch rows)" if rows > 1 else ""
            raise CheckFailed(
                f"sampled tokens{at} do not follow the target's distribution (chi-square p = {p:.2g} <= {ALPHA:g})",
                {
                    "params": describe(params),
                    "temperature": 1.0,
                    "runs": RUNS,
                    "batch_rows": rows,
                    "most_overdrawn": list(worst),
                    "observed": counts[worst],
                    "expected": round(probs.get(worst, 0.0) * RUNS, 1),
                },
            )
    batched = sum(rows > 1 for _, rows in legs)
    job.notes.append(f"{len(legs)} leg(s) x {RUNS} runs" + (f", {batched} drawn as B = {ROWS} rows" if batched else ""))


def legs_of(cls: Any, usable: list[Any]) -> list[tuple[Any, int]]:
    """(params, rows per generation) of each law the check draws: every usable setting at B = 1; for a decoder
    declaring ``batching`` and ``batch_sampling``, the last batchable one drawn as B = ROWS rows instead (with a
    single setting, that setting twice): both paths checked at full power for the cost of as many draws."""
    legs = [(params, 1) for params in usable]
    if not (cls.batching and cls.batch_sampling):
        return legs
    batchable = [i for i, params in enumerate(usable) if cls.batching_error(params) is None]
    if not batchable:
        return legs
    if len(legs) > 1:
        legs[batchable[-1]] = (usable[batchable[-1]], ROWS)
    else:
        legs.append((usable[batchable[-1]], ROWS))
    return legs
