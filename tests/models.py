"""Seeded random-weight causal LMs for exact equivalence tests (no download).

float64 keeps greedy argmaxes free of the near-ties that small random models produce in float32.
"""

from __future__ import annotations

import copy
import os
from functools import cache

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

VOCAB = 96
ARCHS = ("llama", "neox")
FLAT, SHARP = 8.0, 32.0
"""Output-weight scales. FLAT: mean top-1 probability about 0.07 (every node is uncertain; the property tests
scale DynaTree's thresholds down to it). SHARP: mean top-1 probability about 0.4-0.5, spread over (0.1, 1),
so the paper's default thresholds (tau=0.1, rho_stop=0.2, tau_l=0.4, tau_h=0.9) all act and real trees get
drafted with default params."""


def tiny_llama(seed: int, *, attn: str = "sdpa", sharpness: float = FLAT) -> LlamaForCausalLM:
    """A 2-layer Llama with vocab 96, hidden 32, float64, eval mode, seeded weights, lm_head scaled by
    ``sharpness``."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = attn
    return _sharpened(LlamaForCausalLM(cfg), sharpness)


def tiny_neox(seed: int, *, attn: str = "sdpa", sharpness: float = FLAT) -> GPTNeoXForCausalLM:
    """A 2-layer GPT-NeoX (the Pythia architecture: partial rotary embeddings on 25% of each head, parallel
    attention + MLP residual, untied output layer) with vocab 96, hidden 32, float64, eval mode, seeded weights,
    output layer scaled by ``sharpness``."""
    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        rotary_pct=0.25,
        use_parallel_residual=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = attn
    return _sharpened(GPTNeoXForCausalLM(cfg), sharpness)


def _sharpened(model: torch.nn.Module, sharpness: float) -> torch.nn.Module:
    # Larger output weights sharpen the next-token distribution, so drafts are sometimes accepted.
    model = model.to(torch.float64).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpness)
    return model


def tiny_model(arch: str, seed: int, *, attn: str = "sdpa", sharpness: float = FLAT) -> torch.nn.Module:
    """``tiny_llama`` or ``tiny_neox`` by name (``ARCHS``)."""
    make = {"llama": tiny_llama, "neox": tiny_neox}[arch]
    return make(seed, attn=attn, sharpness=sharpness)


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise of std ``scale`` added to every weight (partial acceptance)."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return other


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
# of harness/lossless.py. The CUDA entries are skipped without a GPU (CPU behaviour and runtime unchanged).
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
    """``exact``: ``output == reference``. ``tie_aware``: no error under harness/lossless.py's rule (every emitted
    token the target's argmax up to the numeric noise of its two computation shapes; a row decoded at B > 1 passes
    the other rows' prompts as ``companions``, so the batched shape is a third computation the rule counts)."""
    if rule == "exact":
        assert output == reference
        return
    from dtbench.harness.lossless import check_output

    check = check_output(target, prompt, output, reference, target.device, companions=companions)
    assert check.errors == 0, check
