"""Device-resident tree drafting (issue 46 item 1; decoders/tree/resident.py): the same tree as the host drafting,
node for node, the same committed tokens as greedy ``ar`` on every device, and a clear refusal where it does not
apply.

The tree comparison is the strong one: :func:`draft_tree` (host decisions, one read per level) and
:func:`draft_tree_resident` (static padded levels, no read) draft from the same draft model, prefix and policy,
and must build the same tokens, parents, depths, log-probabilities and ancestor matrix in the same order, whatever
the breadth, depth cap, node budget (its cut mid-level included), tree root, pruning mode and tau.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import DEVICES, assert_lossless, decoder_steps, device_zoo, examples, model_zoo, run_decoder

from dtbench.decoders import fixed_tree
from dtbench.decoders.dynatree import DynamicPolicy, DynaTreeParams
from dtbench.decoders.fixed_tree import FixedPolicy
from dtbench.decoders.tree import (
    DraftSession,
    TokenTree,
    draft_tree,
    draft_tree_resident,
    level_slots,
    tree_capacity,
)
from dtbench.harness import registry
from dtbench.testing.fixtures import SHARP

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = list(range(3, 30))


def _draft_both(draft, policy, depth_cap, tree_root, prune, root=5):
    trees = []
    for resident in (False, True):
        session = DraftSession(draft, PROMPT)
        tree = TokenTree(
            root, policy.n_max, tree_capacity(policy.max_breadth, depth_cap, policy.n_max), "cpu", spare=int(resident)
        )
        if resident:
            got = draft_tree_resident(session, tree, root, policy, depth_cap, tree_root=tree_root, prune=prune)
            tree.size, tree.max_depth = int(got.size), int(got.max_depth)
        else:
            draft_tree(session, tree, root, policy, depth_cap, "per_level", tree_root=tree_root, prune=prune)
        trees.append(tree)
    return trees


def _assert_same_tree(host: TokenTree, resident: TokenTree) -> None:
    n = host.size
    assert resident.size == n and resident.max_depth == host.max_depth
    for name in ("tokens", "parents", "depths", "logp", "cum_logp"):
        assert torch.equal(getattr(resident, name)[:n], getattr(host, name)[:n]), name
    assert torch.equal(resident.ancestors(), host.ancestors())


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    depth=st.integers(1, 4),
    branching=st.integers(1, 3),
    n_max=st.integers(1, 24),
    tau=st.sampled_from([0.0, 0.02, 0.1]),
    tree_root=st.sampled_from(["paper", "pending"]),
    prune=st.sampled_from(["leaf", "skip"]),
    sharp=st.booleans(),
)
def test_resident_draft_builds_the_host_tree(depth, branching, n_max, tau, tree_root, prune, sharp):
    _, draft = model_zoo(sharpness=SHARP if sharp else 8.0)["perturbed"]
    policy = FixedPolicy(depth, branching, tau, n_max)
    offset = 1 if tree_root == "paper" else 0
    host, resident = _draft_both(draft, policy, depth + offset, tree_root, prune)
    _assert_same_tree(host, resident)


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_max=st.integers(1, 40),
    d0=st.integers(1, 4),
    history=st.booleans(),
    tree_root=st.sampled_from(["paper", "pending"]),
)
def test_resident_draft_builds_dynatrees_host_tree(n_max, d0, history, tree_root):
    """DynaTree's breadth rule and depth gate evaluated on the padded slots give the host's tree (sharp models, so
    confidences straddle tau_l/tau_h and paths pass rho_stop/rho_deep)."""
    _, draft = model_zoo(sharpness=SHARP)["perturbed"]
    params = DynaTreeParams(n_max=n_max, d0=d0, d_max=d0 + 2, history_adaptation=history, tree_root=tree_root)
    policy = DynamicPolicy(params)
    offset = 1 if tree_root == "paper" else 0
    host, resident = _draft_both(draft, policy, policy.depth_limit + offset, tree_root, "leaf")
    _assert_same_tree(host, resident)


def test_level_slots_bound_each_level():
    assert level_slots(1, 3, 5, 256) == [1, 3, 9, 27]  # paper root: u0, then B^d
    assert level_slots(3, 3, 4, 10) == [3, 9, 10]  # capped at N_max
    assert level_slots(2, 2, 1, 8) == []  # depth cap 1: the root's children are leaves


@pytest.mark.parametrize("on", DEVICES)
@pytest.mark.parametrize("resident", ["draft", "full"])
@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("fixed_tree", {"depth": 3, "branching": 2, "tau": 0.0}),
        ("fixed_tree", {"depth": 4, "branching": 3, "n_max": 20, "tree_root": "pending", "prune": "skip"}),
        ("dynatree", {}),
        ("dynatree", {"n_max": 12, "cache_strategy": "rebuild"}),
    ],
    ids=["fixed-paper", "fixed-pending-skip", "dynatree", "dynatree-rebuild"],
)
def test_resident_decoders_are_lossless_and_match_the_host_loop(on, resident, name, params):
    """Every committed token equals greedy ``ar``'s (under the device's rule), and the Steps (tokens, drafted,
    accepted, depth) equal the host loop's on CPU, where both compute in float64."""
    dev, dtype, rule = on
    target, draft = device_zoo(dev, dtype, sharpness=SHARP)["perturbed"]
    cls = registry.get(name)
    T = 40
    ar = registry.get("ar")
    reference = run_decoder(ar(target, None, ar.Params()), PROMPT, T)
    decoder = cls(target, draft, cls.Params(**params, resident=resident))
    assert_lossless(target, PROMPT, run_decoder(decoder, PROMPT, T), reference, rule)
    if dev == "cpu":
        host = cls(target, draft, cls.Params(**params))
        fields = [
            [(s.tokens, s.drafted, s.accepted, s.depth) for s in decoder_steps(d, PROMPT, T)] for d in (decoder, host)
        ]
        assert fields[0] == fields[1]
        assert max(s.depth for s in decoder_steps(decoder, PROMPT, T)) >= 2  # real trees, not a one-token fallback


def test_resident_refusals_are_one_line():
    with pytest.raises(ValueError, match="per_level"):
        fixed_tree.FixedTreeParams(resident="full", draft_strategy="per_node")
    cls = registry.get("dynatree")
    params = cls.Params(resident="draft")
    assert "greedy" in cls.sampling_error(params)
    assert "one row" in cls.batching_error(params)
    assert cls.sampling_error(cls.Params()) is None and cls.batching_error(cls.Params()) is None
