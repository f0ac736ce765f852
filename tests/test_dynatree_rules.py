"""Pure tests of DynaTree's rules (paper section 3): the confidence-driven breadth rule, the depth gate, the history
controller's proportional update and the policy's switches, each against the paper's formulas written out here.

Split from tests/test_tree_toolkit.py (the tree toolkit's own tests); no language model involved.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from models import examples

from dtbench.decoders.dynatree import (
    DynamicPolicy,
    DynaTreeParams,
    HistoryController,
    breadth_rule,
    depth_gate,
)

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

FAST = settings(max_examples=examples(60), deadline=None)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one thread

# ---------------------------------------------------------------------------------------------- DynaTree rules


@FAST
@given(
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=20),
    st.floats(0.02, 0.98),
    st.floats(0.01, 0.97),
    st.lists(st.integers(1, 5), min_size=3, max_size=3),
)
def test_breadth_rule_matches_paper(conf, tau_h, tau_l, bs):
    assume(tau_l < tau_h)
    b_min, b_mid, b_max = sorted(bs)
    got = breadth_rule(torch.tensor(conf, dtype=torch.float64), tau_h, tau_l, b_min, b_mid, b_max).tolist()
    want = [b_min if c >= tau_h else b_mid if tau_l <= c < tau_h else b_max for c in conf]
    assert got == want


@FAST
@given(
    st.integers(0, 10),
    st.lists(st.floats(1e-9, 1.0), min_size=1, max_size=20),
    st.integers(1, 8),
    st.integers(2, 10),
    st.floats(1e-6, 0.5),
    st.floats(1e-6, 0.99),
)
def test_depth_gate_matches_paper(depth, probs, d0, d_max, rho_stop, rho_deep):
    assume(d0 < d_max and rho_stop < rho_deep)
    assume(all(abs(p - r) > 1e-9 * max(p, r) * 10 for p in probs for r in (rho_stop, rho_deep)))
    got = depth_gate(depth, torch.tensor(probs, dtype=torch.float64).log(), d0, d_max, rho_stop, rho_deep).tolist()
    want = [depth < d_max and p >= rho_stop and (depth < d0 or p >= rho_deep) for p in probs]
    assert got == want


@FAST
@given(
    st.lists(st.tuples(st.integers(0, 10), st.integers(0, 20)), min_size=1, max_size=30),
    st.integers(1, 6),
    st.floats(0.05, 0.95),
    st.floats(0.1, 3.0),
    st.floats(0.01, 1.0),
    st.integers(2, 10),
)
def test_history_controller_is_the_papers_proportional_update(history, window, target, eta_d, eta_h, d_max):
    """D_0, tau_h (section 3.3) and tau_l (Algorithm 1 line 7, same clipped form, its own step eta_l)."""
    eta_l = eta_h / 2
    ctl = HistoryController(window, target, eta_d, eta_h, d_max, eta_l=eta_l)
    two = HistoryController(window, target, eta_d, eta_h, d_max)  # section 3.3's pair only
    d0, tau_h, tau_l, recorded = 2.0, 0.9, 0.4, []
    for acc, size in history:
        acc = min(acc, size)
        new_d0, new_tau_h, new_tau_l = ctl.update(acc, size, d0, tau_h, tau_l)
        assert two.update(acc, size, d0, tau_h) == (new_d0, new_tau_h)
        assert two.update(0, 0, d0, tau_h, tau_l)[2] == tau_l  # eta_l None: tau_l never moves
        if size == 0:
            assert (new_d0, new_tau_h, new_tau_l) == (d0, tau_h, tau_l)
            continue
        recorded.append(acc / size)
        a_bar = sum(recorded[-window:]) / len(recorded[-window:])
        assert math.isclose(new_d0, min(max(d0 + eta_d * (a_bar - target), 1), d_max - 1), abs_tol=1e-12)
        assert math.isclose(new_tau_h, min(max(tau_h - eta_h * (a_bar - target), 0), 1), abs_tol=1e-12)
        assert math.isclose(new_tau_l, min(max(tau_l - eta_l * (a_bar - target), 0), 1), abs_tol=1e-12)
        d0, tau_h, tau_l = new_d0, new_tau_h, new_tau_l
        assert 1 <= d0 <= d_max - 1 and 0 <= tau_h <= 1 and 0 <= tau_l <= 1


def test_dynamic_policy_switches():
    p = DynaTreeParams(dynamic_breadth=False, dynamic_depth=False, history_adaptation=False, branching=3, d0=4)
    pol = DynamicPolicy(p)
    assert pol.breadth(torch.tensor([0.99, 0.5, 0.01])).tolist() == [3, 3, 3]
    assert pol.depth_limit == 4 and pol.max_breadth == 3
    assert pol.expandable(3, torch.tensor([-50.0])).tolist() == [True]
    assert pol.expandable(4, torch.tensor([0.0])).tolist() == [False]
    full = DynamicPolicy(DynaTreeParams())
    assert full.breadth(torch.tensor([0.95, 0.5, 0.1])).tolist() == [1, 2, 3]
    assert full.depth_limit == 8 and full.max_breadth == 3
    # deep expansion beyond D0=5 only for likely paths; early stop below rho_stop
    assert full.expandable(6, torch.tensor([math.log(0.9), math.log(0.3)])).tolist() == [True, False]
    assert full.expandable(2, torch.tensor([math.log(0.3), math.log(0.1)])).tolist() == [True, False]
    assert full.expandable(8, torch.tensor([0.0])).tolist() == [False]
