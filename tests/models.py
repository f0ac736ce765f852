"""Seeded random-weight causal LMs for exact equivalence tests (no download).

float64 keeps greedy argmaxes free of the near-ties that small random models produce in float32.
"""

from __future__ import annotations

import copy
from functools import lru_cache

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 96


def tiny_llama(seed: int, *, attn: str = "sdpa") -> LlamaForCausalLM:
    """A 2-layer Llama with vocab 96, hidden 32, float64, eval mode, seeded weights."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = attn
    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    # Larger output weights sharpen the next-token distribution, so drafts are sometimes accepted.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with Gaussian noise of std ``scale`` added to every weight (partial acceptance)."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return other


@lru_cache(maxsize=None)
def model_zoo(attn: str = "sdpa") -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """(target, draft) pairs for the three kinds of draft: the target itself, a perturbed copy, an unrelated model."""
    target = tiny_llama(0, attn=attn)
    return {
        "self": (target, target),
        "perturbed": (target, perturbed(target, 0.005, seed=1)),
        "unrelated": (target, tiny_llama(7, attn=attn)),
    }


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, EOS ignored: the ground truth for ``ar``."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def run_decoder(decoder, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Collect a decoder's committed tokens, truncated to T exactly as the runner does."""
    tokens: list[int] = []
    for step in decoder.generate(torch.tensor([prompt]), max_new_tokens):
        tokens.extend(step.tokens)
        if len(tokens) >= max_new_tokens:
            break
    return tokens[:max_new_tokens]
