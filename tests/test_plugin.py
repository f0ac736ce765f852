"""A third-party decoder package (examples/dtbench-prompt-lookup) installs with pip, registers itself under the
``dtbench.decoders`` entry-point group, is found by dtbench's registry, and reproduces ar token for token."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtbench.decoders.ar import ARParams, Autoregressive
from models import VOCAB, model_zoo, run_decoder

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "examples" / "dtbench-prompt-lookup"


@pytest.fixture(scope="session")
def plugin():
    """Install the example plugin (non-editable, as a user would) into this environment; its module."""
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not available in this environment, so the example plugin cannot be installed")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--force-reinstall", "-q",
         str(PLUGIN_DIR)],
        check=True,
    )
    importlib.invalidate_caches()
    return importlib.import_module("dtbench_prompt_lookup")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one intra-op thread (and do not fight other processes for cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_entry_point_registered(plugin):
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="dtbench.decoders")}
    assert "prompt_lookup" in eps
    ep = eps["prompt_lookup"]
    assert ep.value == "dtbench_prompt_lookup:PromptLookup"
    assert ep.dist is not None and ep.dist.name == "dtbench-prompt-lookup"
    assert ep.load() is plugin.PromptLookup
    assert "site-packages" in plugin.__file__  # the installed copy, not the source tree


def test_found_by_the_registry(plugin):
    from dtbench.harness import registry

    entry = registry.discover()["prompt_lookup"]
    assert entry.distribution == "dtbench-prompt-lookup"
    assert registry.get("prompt_lookup") is plugin.PromptLookup
    params = registry.validate_params("prompt_lookup", {"ngram_size": 2, "num_draft_tokens": 4})
    assert params == plugin.PromptLookupParams(ngram_size=2, num_draft_tokens=4)
    cls = plugin.PromptLookup
    assert cls.lossless and not cls.needs_draft


# Small alphabets make prompts repeat themselves, so lookups find matches and drafts get accepted.
prompts = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
    st.lists(st.integers(3, 8), min_size=1, max_size=24),
)


@settings(max_examples=40, deadline=None)
@given(prompt=prompts, T=st.integers(1, 48), n=st.integers(1, 4), d=st.integers(1, 10))
def test_reproduces_ar(plugin, prompt, T, n, d):
    target, _ = model_zoo()["self"]
    decoder = plugin.PromptLookup(target, None, plugin.PromptLookupParams(ngram_size=n, num_draft_tokens=d))
    assert run_decoder(decoder, prompt, T) == run_decoder(Autoregressive(target, None, ARParams()), prompt, T)


def test_steps_accept_drafts(plugin):
    """On a repetitive context drafts are proposed and accepted; counters are consistent."""
    target, _ = model_zoo()["self"]
    ar = run_decoder(Autoregressive(target, None, ARParams()), [5, 6, 7], 60)
    prompt = [5, 6, 7] + ar[:40]  # the continuation of ar[:40] repeats text the model itself produced
    decoder = plugin.PromptLookup(target, None, plugin.PromptLookupParams(ngram_size=3, num_draft_tokens=8))
    steps = list(decoder.generate(torch.tensor([prompt]), 20))
    assert sum(s.accepted for s in steps) > 0
    for s in steps:
        assert 0 <= s.accepted <= s.drafted == s.tree_size == s.depth <= 8
        assert len(s.tokens) == s.accepted + 1


@pytest.mark.parametrize(
    "tokens,max_n,expected",
    [
        ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),  # the 3-gram [1, 2, 3] recurs: copy what followed
        ([1, 2, 3, 4, 7, 3, 4], 3, [7, 3, 4]),  # no 3-gram match, the 2-gram [3, 4] does
        ([5, 1, 6, 1, 8, 1], 2, [8, 1]),  # the most recent earlier occurrence wins
        ([1, 2, 3], 3, []),  # nothing recurs
        ([4], 2, []),
    ],
)
def test_ngram_index(plugin, tokens, max_n, expected):
    assert plugin.NgramIndex(max_n, tokens).lookup(3) == expected
    grown = plugin.NgramIndex(max_n, tokens[:1])
    for t in tokens[1:]:
        grown.extend([t])
    assert grown.lookup(3) == expected
