"""Seeded random-weight causal LMs for exact equivalence tests (no download): pairs of the test kit's tiny models
(:mod:`dtbench.testing.fixtures`), the device axis of the property suite and helpers that run decoders.

float64 keeps greedy argmaxes free of the near-ties that small random models produce in float32.
"""

from __future__ import annotations

import copy
import os
from functools import cache

import pytest
import torch

from dtbench.testing.compiled import MAX_LEN
from dtbench.testing.fixtures import FLAT, perturbed, tiny_model

# One static KV length for the compiled tests of the float64 zoo (issue 57 item 3): a graph's shapes include the static
# cache, so tests at 128, 192 and 512 compiled the same buckets of the same model shape three times over. At one length
# (the conformance kit's) inductor's FX graph cache, on disk and shared by both xdist workers, serves a later test the
# kernels of a bucket an earlier one compiled: 2 buckets took 35-40 s cold and 6.4 s from the cache on the 2-core VM
# (dynamo still traces each). Tests that need graphs of their own (a dynamo graph count) keep a length of their own.
COMPILED_MAX_LEN = MAX_LEN


@cache
def model_zoo(
    attn: str = "sdpa", arch: str = "llama", sharpness: float = FLAT
) -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """(target, draft) pairs for the three kinds of draft: the target itself (accepts everything), a perturbed
    copy (accepts some), an unrelated model (accepts almost nothing)."""
    target = tiny_model(arch, 0, attn=attn, sharpness=sharpness)
    return {
        "self": (target, target),
        "perturbed": (target, perturbed(target, 0.005, seed=1)),
        "unrelated": (target, tiny_model(arch, 7, attn=attn, sharpness=sharpness)),
    }


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, EOS ignored: the ground truth for ``ar``."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def decoder_steps(decoder, prompt: list[int], max_new_tokens: int) -> list:
    """A decoder's Steps until T tokens are committed (the runner stops iterating there too)."""
    steps, n = [], 0
    for step in decoder.generate(torch.tensor([prompt], device=decoder.target.device), max_new_tokens):
        steps.append(step)
        n += len(step.tokens)
        if n >= max_new_tokens:
            break
    return steps


def run_decoder(decoder, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Collect a decoder's committed tokens, truncated to T exactly as the runner does."""
    tokens: list[int] = []
    for step in decoder.generate(torch.tensor([prompt], device=decoder.target.device), max_new_tokens):
        tokens.extend(step.tokens)
        if len(tokens) >= max_new_tokens:
            break
    return tokens[:max_new_tokens]


# --- the device axis of the property suite (issue 38 item 3) ---------------------------------------------------------

EXAMPLES_ENV = "DTBENCH_HYPOTHESIS_EXAMPLES"  # caps every property test's max_examples (the GPU check's tests step)


def examples(n: int) -> int:
    """``n`` hypothesis examples, or fewer when ``$DTBENCH_HYPOTHESIS_EXAMPLES`` caps them (an explicit
    ``@settings(max_examples=...)`` overrides any hypothesis profile, so the cap is applied here)."""
    cap = os.environ.get(EXAMPLES_ENV)
    return min(n, int(cap)) if cap and cap.isdigit() and int(cap) > 0 else n


def _cuda() -> bool:
    return torch.cuda.is_available()


# (device, dtype, rule): CPU float64 as always; on CUDA float32 token for token and float16 under the tie-aware rule
# of harness/measurement/lossless.py. The CUDA entries are skipped without a GPU (CPU behaviour and runtime unchanged).
DEVICES = [
    pytest.param(("cpu", torch.float64, "exact"), id="cpu"),
    pytest.param(
        ("cuda", torch.float32, "exact"), id="cuda-float32", marks=pytest.mark.skipif(not _cuda(), reason="no CUDA")
    ),
    pytest.param(
        ("cuda", torch.float16, "tie_aware"),
        id="cuda-float16",
        marks=pytest.mark.skipif(not _cuda(), reason="no CUDA"),
    ),
]


@cache
def on_device(model: torch.nn.Module, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` on ``device`` in ``dtype``: ``model`` itself for CPU float64, else a copy made once per model (a
    model is cached by identity, so pairs sharing a model share its copy)."""
    if device == "cpu" and dtype == torch.float64:
        return model
    return copy.deepcopy(model).to(device=device, dtype=dtype).eval()


@cache
def device_zoo(
    device: str, dtype: torch.dtype, attn: str = "sdpa", arch: str = "llama", sharpness: float = FLAT
) -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """:func:`model_zoo`'s seeded pairs on ``device`` in ``dtype`` (CPU float64: the very same objects)."""
    zoo = model_zoo(attn, arch, sharpness)
    return {kind: (on_device(t, device, dtype), on_device(d, device, dtype)) for kind, (t, d) in zoo.items()}


def assert_lossless(
    target: torch.nn.Module,
    prompt: list[int],
    output: list[int],
    reference: list[int],
    rule: str,
    companions: list[list[int]] | None = None,
):
    """``exact``: ``output == reference``. ``tie_aware``: no error under harness/measurement/lossless.py's rule (every emitted
    token the target's argmax up to the numeric noise of its two computation shapes; a row decoded at B > 1 passes
    the other rows' prompts as ``companions``, so the batched shape is a third computation the rule counts)."""
    if rule == "exact":
        assert output == reference
        return
    from dtbench.harness.measurement.lossless import check_output

    check = check_output(target, prompt, output, reference, target.device, companions=companions)
    assert check.errors == 0, check
