"""The conformance kit's ``sampling`` check (issue 56): a sampled decoder's outputs follow the target's distribution.

On a tiny float64 Llama with a 6-token vocabulary, the exact law of the first M = 3 generated tokens under the
target (temperature, top-k, top-p in transformers' order: :class:`~dtbench.decoders.sampling.SamplingSettings`) is
computed by enumeration; the decoder generates RUNS times with independently seeded generators and a chi-square test
compares the counts (bins expecting fewer than 5 merged). An exact decoder fails with probability ALPHA per setting.
Each generation asks for LENGTH = 7 tokens and stops at the step that completes its first M: at T = M a chain's first
iteration could draft one token only (its drafts are capped by what is left of T), so a wrong rule for a second or
later drafted token went unseen (issue 57's review); later steps draw after the first M tokens and cannot change them.
The draft is a perturbed copy of the target (noise 0.3: drafts accepted and rejected). The law is enumerated in
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


def p_value(decoder: Any, settings: Any) -> tuple[float, dict[tuple[int, ...], int]]:
    """(chi-square p-value of RUNS seeded generations against :func:`exact`, the counts)."""
    from scipy import stats

    counts: dict[tuple[int, ...], int] = {}
    for run in range(RUNS):
        decoder.sampling, decoder.generator = settings, torch.Generator().manual_seed(run)
        tokens: list[int] = []
        for step in decoder.generate(torch.tensor([PROMPT]), LENGTH):
            tokens.extend(step.tokens)
            if len(tokens) >= M:
                break
        counts[tuple(tokens[:M])] = counts.get(tuple(tokens[:M]), 0) + 1
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
    for params in usable[:MAX_SETTINGS]:
        p, counts = p_value(build(cls, params, target, draft), settings)
        if p <= ALPHA:
            probs = exact(settings)
            worst = max(counts, key=lambda k: counts[k] - probs.get(k, 0.0) * RUNS)
            raise CheckFailed(
                f"sampled tokens do not follow the target's distribution (chi-square p = {p:.2g} <= {ALPHA:g})",
                {
                    "params": describe(params),
                    "temperature": 1.0,
                    "runs": RUNS,
                    "most_overdrawn": list(worst),
                    "observed": counts[worst],
                    "expected": round(probs.get(worst, 0.0) * RUNS, 1),
                },
            )
    job.notes.append(f"{min(len(usable), MAX_SETTINGS)} setting(s) x {RUNS} runs")
