"""The runner's measurement and metric code on every built-in decoder (issue 8, items 14 and 15).

Forward passes are counted by hooks the runner installs (never declared by decoders) and must equal the counts
each algorithm implies; chain decoders never draft past T; every built-in decoder's sample row is consistent.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import examples, model_zoo

from dtbench.harness import registry
from dtbench.harness.data.prompt import Prompt
from dtbench.harness.measurement.measure import ForwardCounter, measure
from dtbench.harness.measurement.observation import sample_row
from dtbench.testing.common import scratch_root
from dtbench.testing.fixtures import HEAD, STORE, builtin_settings, write_eagle, write_medusa

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

# Every declared setting but StreamingLLM's evicting windows (their prefill runs in chunks and they are lossy against
# ar by design: tests/test_streaming.py counts their forwards).
BUILTIN = [(n, p) for n, p in builtin_settings() if p.get("window", 64) >= 64]

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
PROMPT = list(range(3, 20))


def build(name, params, kind="perturbed"):
    target, draft = model_zoo()[kind]
    cls = registry.get(name)
    if params.get("head") == HEAD:  # a random head in the published format (Medusa-1, EAGLE-1/2), sized for the target
        folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=scratch_root()))
        cfg = target.config
        write = write_medusa if name == "medusa" else write_eagle
        params = {**params, "head": str(write(folder, hidden=cfg.hidden_size, vocab=cfg.vocab_size))}
    if params.get("tokens") == STORE:  # a REST datastore: the prompt's tokens and random ones
        path = Path(tempfile.mkdtemp(prefix="rest-", dir=scratch_root())) / "store.npy"
        np.save(path, np.array([*PROMPT, 30, 31, -1, *range(90, 3, -1)]))
        params = {**params, "tokens": str(path)}
    return cls(target, draft if cls.needs_draft else None, cls.Params(**params))


def test_every_builtin_decoder_is_covered():
    """Every built-in decoder that decodes in this process; a ``requests`` decoder (``server``: measured through HTTP
    requests to an engine) is covered by tests/test_server_engine.py against a real llama.cpp server."""
    builtin = {
        n for n, e in registry.discover().items() if e.distribution == "dtbench" and not registry.get(n).requests
    }
    assert builtin == {name for name, _ in builtin_settings()}
    assert {n for n, e in registry.discover().items() if e.distribution == "dtbench" and registry.get(n).requests} == {
        "server"
    }


@pytest.mark.parametrize("name, params", BUILTIN, ids=[f"{n}-{'-'.join(map(str, p.values()))}" for n, p in BUILTIN])
def test_sample_row_and_forward_counts(name, params):
    T = 12
    ref = measure(build("ar", {}), PROMPT, T, CPU)
    m = measure(build(name, params), PROMPT, T, CPU)
    row = sample_row(m, Prompt(0, "doc", tuple(PROMPT)), False, ref.tokens)
    assert row["new_tokens"] == T and row["lossless"] is True and row["first_divergence"] is None
    assert row["iterations"] == len(m.steps) == len(row["step_times_s"]) and sum(row["step_tokens"]) >= T
    assert row["tokens_per_iteration"] == pytest.approx(T / row["iterations"])
    assert 0 < row["ttft_s"] <= row["total_s"] and row["throughput"] == pytest.approx(T / row["total_s"])
    stats = row["step_stats"]
    tf, df, drafted = stats["target_forwards"], stats["draft_forwards"], stats["drafted"]
    assert row["target_forwards"] == sum(tf)
    if row["draft_depth"]:
        assert 0 <= row["acceptance_rate"] <= 1
        assert row["acceptance_incl_bonus"] > row["acceptance_rate"]
    assert stats["target_tokens"][0] >= len(PROMPT)  # the prefill fed the whole prompt
    if name in ("ar", "streaming_ar", "hf_generate"):
        assert tf == [1] * T and df is None and row["draft_forwards"] is None
    elif name in ("ngram", "suffix"):
        assert tf == [1] * len(tf)  # one verification forward per Step; the draft model only for fallback drafts
        assert stats["target_tokens"][1:] == [d + 1 for d in drafted[1:]]
        assert (df is not None and sum(df) > 0) == (params.get("fallback") == "draft")
        assert any(k.endswith("_bytes") and v > 0 for k, v in row["step_stats"]["state"].items())
    elif name == "rest":
        assert tf == [1] * len(tf) and stats["target_tokens"][1:] == [d + 1 for d in drafted[1:]]
        assert sum(drafted) > 0 and row["step_stats"]["state"]["datastore_tokens"] > len(PROMPT)
    elif name in ("linear", "streaming_spec"):
        assert tf == [1] * len(tf)
        assert df == drafted  # one draft forward per drafted token
        assert stats["target_tokens"][1:] == [d + 1 for d in drafted[1:]]  # pending + K drafts, one forward
    elif name in ("fixed_tree", "dynatree", "medusa", "eagle"):
        if params.get("cache_strategy") == "rebuild":
            assert tf == [1] + [2] * (len(tf) - 1)  # verify, then re-run the committed path (the paper's)
        else:
            assert tf == [1] * len(tf)
            fed = [d + 1 for d in drafted[1:]]  # root + tree nodes, one forward
            if params.get("resident") == "full":  # the capacity-padded tree is verified (decoders/tree/resident.py)
                assert all(t >= f for t, f in zip(stats["target_tokens"][1:], fed))
            else:
                assert stats["target_tokens"][1:] == fed
        assert row["draft_forwards"] == sum(df) >= sum(1 for d in drafted if d)
    elif name in ("token_recycling", "lookahead"):  # no draft model: one target forward per step
        assert tf == [1] * len(tf) and df is None and row["draft_forwards"] is None
        side = [0] * len(tf)  # Lookahead's window rides in the verify forward: W - 1, then W more per level
        if name == "lookahead":
            w, levels = params["window_size"], params["ngram_size"] - 1
            side = [0] + [w - 1 + (min(i, levels) - 1) * w for i in range(1, len(tf))]
        assert stats["target_tokens"][1:] == [d + 1 + s for d, s in zip(drafted[1:], side[1:])]
        assert stats["state"] and all(v > 0 for v in stats["state"].values())
    elif name == "hf_assisted":
        assert tf == [1] * len(tf)  # one target verification per Step
        assert all(d >= 1 for d in df)


def test_forward_counter_with_shared_target_and_draft():
    target, _ = model_zoo()["self"]
    counter = ForwardCounter(target, target)
    with counter:
        target(input_ids=torch.tensor([[3, 4, 5]]))
    assert counter.snapshot() == (1, None, 3, None)
    target(input_ids=torch.tensor([[3]]))  # hooks removed on exit
    assert counter.snapshot()[0] == 1


@settings(max_examples=examples(25), deadline=None)
@given(
    T=st.integers(1, 16),
    k=st.integers(1, 6),
    kind=st.sampled_from(["self", "perturbed"]),
    name=st.sampled_from(["linear", "streaming_spec"]),
)
def test_chain_decoders_never_draft_past_T(T, k, kind, name):
    params = {"k": k} if name == "linear" else {"k": k, "sinks": 4, "window": 64}
    steps = list(build(name, params, kind).generate(torch.tensor([PROMPT]), T))
    assert sum(len(s.tokens) for s in steps) == T  # nothing committed (or drafted and timed) beyond T
    produced = 0
    for s in steps:
        assert s.drafted <= max(0, T - produced - 1)
        produced += len(s.tokens)
