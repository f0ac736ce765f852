"""StreamingLLM decoders: streaming_spec equals streaming_ar token for token, streaming_ar equals a literal
StreamingLLM implementation (window keys re-rotated on every eviction, positions = cache indices, via the
model's own rotary code), equals plain ar when nothing is evicted, and the cache stays within S + R entries."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import examples, model_zoo, run_decoder
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM
from transformers.models.gpt_neox import modeling_gpt_neox
from transformers.models.llama import modeling_llama

from dtbench.decoders import streaming
from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.decoders.streaming import (
    StreamingAR,
    StreamingKV,
    StreamingParams,
    StreamingSpecParams,
    StreamingSpeculative,
)
from dtbench.testing.fixtures import VOCAB, perturbed

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)
DRAFTS = ["self", "perturbed", "unrelated"]


def tiny_neox(seed: int) -> GPTNeoXForCausalLM:
    """A 2-layer GPT-NeoX (Pythia architecture: partial rotary, 4 of 8 head dims), vocab 96, float64."""
    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        rotary_pct=0.5,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    model = GPTNeoXForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


_NEOX: dict[str, tuple] = {}


def neox_pair():
    if not _NEOX:
        target = tiny_neox(3)
        _NEOX["pair"] = (target, perturbed(target, 0.005, seed=4))
    return _NEOX["pair"]


# ---- a literal StreamingLLM, independent of dtbench's implementation ---------------------------------------


def _rope_parts(model):
    """(rotary embedding module, apply_rotary_pos_emb) of the model, taken from transformers itself."""
    if model.config.model_type == "gpt_neox":
        return model.gpt_neox.rotary_emb, modeling_gpt_neox.apply_rotary_pos_emb
    return model.model.rotary_emb, modeling_llama.apply_rotary_pos_emb


@torch.inference_mode()
def literal_streaming(model, prompt: list[int], T: int, S: int, R: int, *, logits_out: list | None = None):
    """StreamingLLM as Xiao et al. describe it: keep S sinks + the most recent tokens, the cache never above
    S + R entries, each token processed with default positions (= cache length), and after an eviction every
    kept window key re-rotated by minus the number of evicted tokens (transformers' rotary code)."""
    rotary, apply_rope = _rope_parts(model)
    cache = DynamicCache()

    def run(tokens: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True).logits[0, -1]

    def step(token: int) -> torch.Tensor:
        length = cache.get_seq_length()
        e = length - (S + R - 1)
        if e > 0:
            for layer in cache.layers:
                window = layer.keys[..., S + e :, :]
                cos, sin = rotary(window, position_ids=torch.tensor([[-e]]))
                _, window = apply_rope(window, window, cos, sin)
                layer.keys = torch.cat((layer.keys[..., :S, :], window), dim=-2)
                layer.values = torch.cat((layer.values[..., :S, :], layer.values[..., S + e :, :]), dim=-2)
        return run([token])

    logits = run(prompt[: S + R])
    for token in prompt[S + R :]:
        logits = step(token)
    out: list[int] = []
    while True:
        if logits_out is not None:
            logits_out.append(logits)
        out.append(int(logits.argmax()))
        if len(out) == T:
            return out
        logits = step(out[-1])


# ---- equivalences --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", DRAFTS)
@settings(max_examples=examples(20), deadline=None)
@given(prompt=prompts, T=st.integers(1, 48), S=st.integers(0, 3), R=st.integers(1, 16), k=st.integers(1, 8))
def test_spec_equals_streaming_ar(kind, prompt, T, S, R, k):
    target, draft = model_zoo()[kind]
    expected = run_decoder(StreamingAR(target, None, StreamingParams(sinks=S, window=R)), prompt, T)
    spec = StreamingSpeculative(target, draft, StreamingSpecParams(sinks=S, window=R, k=k))
    assert run_decoder(spec, prompt, T) == expected


@settings(max_examples=examples(20), deadline=None)
@given(prompt=prompts, T=st.integers(1, 40), S=st.integers(0, 3), R=st.integers(1, 12))
def test_streaming_ar_equals_literal_streamingllm(prompt, T, S, R):
    target, _ = model_zoo()["self"]
    got = run_decoder(StreamingAR(target, None, StreamingParams(sinks=S, window=R)), prompt, T)
    assert got == literal_streaming(target, prompt, T, S, R)


@torch.inference_mode()
def test_logits_match_literal_streamingllm():
    """Not only the argmaxes: every step's logits agree with the literal implementation (fp32 RoPE angles)."""
    target, _ = model_zoo()["self"]
    prompt, T, S, R = list(range(5, 30)), 40, 2, 7  # prompt longer than S + R: a streamed prefill too
    reference: list[torch.Tensor] = []
    tokens = literal_streaming(target, prompt, T, S, R, logits_out=reference)
    state = StreamingKV(target, S, R)
    logits, _ = state.forward(prompt, last_only=True)
    got = [logits[-1]]
    for token in tokens[:-1]:
        state.enforce_budget()
        got.append(state.forward([token])[0][-1])
    for a, b in zip(got, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@settings(max_examples=examples(15), deadline=None)
@given(prompt=prompts, T=st.integers(1, 40))
def test_no_eviction_equals_ar(prompt, T):
    """With S + R beyond prompt + T nothing is evicted: the position handling reduces to plain ar."""
    target, _ = model_zoo()["self"]
    ar = run_decoder(Autoregressive(target, None, ARParams()), prompt, T)
    assert run_decoder(StreamingAR(target, None, StreamingParams(sinks=4, window=len(prompt) + T)), prompt, T) == ar


@settings(max_examples=examples(10), deadline=None)
@given(prompt=prompts, T=st.integers(1, 40), S=st.integers(0, 3), R=st.integers(1, 12), k=st.integers(1, 6))
def test_eager_attention(prompt, T, S, R, k):
    """The additive float mask of the eager attention path gives the same result as the literal version."""
    target, draft = model_zoo("eager")["perturbed"]
    expected = literal_streaming(target, prompt, T, S, R)
    assert run_decoder(StreamingAR(target, None, StreamingParams(sinks=S, window=R)), prompt, T) == expected
    spec = StreamingSpeculative(target, draft, StreamingSpecParams(sinks=S, window=R, k=k))
    assert run_decoder(spec, prompt, T) == expected


@settings(max_examples=examples(10), deadline=None)
@given(prompt=prompts, T=st.integers(1, 40), S=st.integers(0, 3), R=st.integers(1, 12), k=st.integers(1, 6))
def test_gpt_neox_partial_rotary(prompt, T, S, R, k):
    """Pythia's architecture (rotary on part of each head): streaming_ar = literal, streaming_spec = streaming_ar."""
    target, draft = neox_pair()
    expected = literal_streaming(target, prompt, T, S, R)
    assert run_decoder(StreamingAR(target, None, StreamingParams(sinks=S, window=R)), prompt, T) == expected
    spec = StreamingSpeculative(target, draft, StreamingSpecParams(sinks=S, window=R, k=k))
    assert run_decoder(spec, prompt, T) == expected
    big = StreamingAR(target, None, StreamingParams(sinks=S, window=len(prompt) + T))
    assert run_decoder(big, prompt, T) == run_decoder(Autoregressive(target, None, ARParams()), prompt, T)


# ---- cache budget and counters --------------------------------------------------------------------------------


@pytest.mark.parametrize("S,R,k", [(2, 8, 4), (0, 5, 7), (3, 1, 3), (4, 12, 8)])
def test_cache_never_exceeds_budget(monkeypatch, S, R, k):
    """Between steps every cache (target and draft) holds at most S + R entries in every layer."""
    states: list[StreamingKV] = []

    class Recording(StreamingKV):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            states.append(self)

    monkeypatch.setattr(streaming, "StreamingKV", Recording)
    target, draft = model_zoo()["perturbed"]
    prompt, T = list(range(3, 23)), 48
    for decoder in (
        StreamingAR(target, None, StreamingParams(sinks=S, window=R)),
        StreamingSpeculative(target, draft, StreamingSpecParams(sinks=S, window=R, k=k)),
    ):
        states.clear()
        produced = 0
        for step in decoder.generate(torch.tensor([prompt]), T):
            if produced >= T:  # the runner stops here; the last step may carry one token more than T needs
                break
            produced += len(step.tokens)
            assert 0 <= step.accepted <= step.drafted
            for state in states:
                for layer in state.cache.layers:
                    assert layer.keys.shape[-2] == layer.values.shape[-2] <= S + R
                assert state.n >= len(prompt)
            # the target has processed every committed token except the newest one
            assert states[0].n == len(prompt) + produced - 1
        assert T <= produced <= T + 1
        assert len(states) == (1 if isinstance(decoder, StreamingAR) else 2)


def test_steps_and_reference():
    target, draft = model_zoo()["perturbed"]
    params = StreamingSpecParams(sinks=2, window=8, k=4)
    spec = StreamingSpeculative(target, draft, params)
    name, ref_params = StreamingSpeculative.reference(params)
    assert spec.reference(params) == (name, ref_params)  # a classmethod: params alone, no models
    assert name == "streaming_ar" and StreamingParams(**ref_params) == StreamingParams(sinks=2, window=8)
    assert StreamingSpeculative.lossless is False and StreamingAR.lossless is False
    steps = list(spec.generate(torch.tensor([list(range(3, 15))]), 30))
    assert sum(len(s.tokens) for s in steps) == 30
    assert steps[0].tokens and steps[0].drafted == 0
    assert all(s.accepted == len(s.tokens) - 1 for s in steps[1:])
    assert all(s.drafted == s.depth <= 4 for s in steps)


def test_unsupported_models_raise():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    with pytest.raises(ValueError, match="model types"):
        StreamingAR(gpt2, None, StreamingParams())
    target, _ = model_zoo()["self"]
    with pytest.raises(ValueError, match="model types"):
        StreamingSpeculative(target, gpt2, StreamingSpecParams())
    with pytest.raises(ValueError, match="draft"):
        StreamingSpeculative(target, None, StreamingSpecParams())


def test_params_validation():
    with pytest.raises(ValueError):
        StreamingParams(window=0)
    with pytest.raises(ValueError):
        StreamingParams(sinks=4, window=8, k=2)  # extra keys are rejected
    assert StreamingParams().sinks + StreamingParams().window == 1024
