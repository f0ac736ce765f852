"""A newcomer sees only dtbench's own output (issue 18, item 1): no transformers deprecation warnings from dtbench's
forwards (``past_key_values`` renamed ``cache``) nor from transformers' assisted generation."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from dtbench.decoders import kv, modelinfo

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


def test_forwards_pass_the_cache_under_the_models_own_keyword():
    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning (past_key_values is deprecated) would fail here
        cache, logits = kv.prefill(model, torch.tensor([[3, 4, 5, 6]]))
        step = kv.forward(model, [int(logits.argmax())], cache)
    assert step.shape == (1, 64) and cache.get_seq_length() == 5
    assert modelinfo.cache_keyword(model) in ("cache", "past_key_values")

    class Old(torch.nn.Module):  # a module with the old keyword keeps getting it
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return None

    assert modelinfo.cache_keyword(Old()) == "past_key_values"


def test_assisted_generation_prints_no_transformers_deprecation():
    from dtbench.decoders.hf_assisted import HFAssisted, HFAssistedParams

    target, draft = tiny_llama(0), tiny_llama(1)
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log = logging.getLogger("transformers.generation.utils")
    handler = Collect(level=logging.DEBUG)
    log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            steps = list(
                HFAssisted(target, draft, HFAssistedParams(num_assistant_tokens=3)).generate(
                    torch.tensor([[3, 4, 5, 6]]), 8
                )
            )
    finally:
        log.removeHandler(handler)
    assert sum(len(s.tokens) for s in steps) == 8
    assert not [m for m in seen if "generation_config" in m], seen
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))], [
        str(w.message) for w in caught
    ]
