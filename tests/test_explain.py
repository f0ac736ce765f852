"""Every speculative cell explains its speedup with no calibration (issue 58 item 2, reports/pricing/explain.py): the time
split, the draft/target cost per forward and the speedup the measured costs and acceptance allow, checked on a fake
clock against hand-computed values."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from dtbench.decoders import base as decoder_base
from dtbench.harness.measurement import forwards, measure
from dtbench.harness.measurement.observation import sample_row
from dtbench.reports.pricing import explain
from dtbench.reports.pricing.pricing import MeasuredCosts, Pricer
from dtbench.testing.common import PRECISIONS, pair
from dtbench.testing.fixtures import FLAT

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

# seconds per forward: (role, prefill?) -> cost; the clock moves only inside forwards, so "other" is 0
COST = {("target", True): 0.5, ("target", False): 0.1, ("draft", True): 0.3, ("draft", False): 0.02}
PROMPT, T = [5, 9, 14, 3, 22, 7, 30, 11], 24


class Clock:
    """A fake clock: each hooked forward adds its :data:`COST` when it returns (the runner's forward timer, whose
    hooks wrap the forward, sees it)."""

    def __init__(self):
        self.t, self.handles = 0.0, []

    def now(self) -> float:
        return self.t

    def attach(self, model, role: str) -> None:
        pending = []

        def pre(module, args, kwargs):
            pending.append(COST[(role, forwards.past_length(forwards.cache_argument(kwargs)) == 0)])

        def post(module, args, kwargs, output):
            self.t += pending.pop()

        self.handles += [
            model.register_forward_pre_hook(pre, with_kwargs=True),
            model.register_forward_hook(post, with_kwargs=True, always_call=True),
        ]


def measured(name: str, monkeypatch) -> dict:
    from dtbench.harness import registry

    target, draft = pair("llama", "perturbed", FLAT, PRECISIONS["cpu"])
    cls = registry.get(name)
    decoder = cls(
        target, draft if cls.needs_draft else None, registry.validate_params(name, {"k": 3} if name == "linear" else {})
    )
    clock = Clock()
    clock.attach(target, "target")
    clock.attach(draft, "draft")
    try:
        monkeypatch.setattr(decoder_base, "clock", clock.now)
        m = measure.measure(decoder, PROMPT, T, torch.device("cpu"))
    finally:
        for h in clock.handles:
            h.remove()
    prompt = type("P", (), {"index": 0, "document": "", "token_ids": PROMPT})()
    return sample_row(m, prompt, False, None)


def test_a_chain_cells_time_split_cost_and_allowed_speedup_by_hand(monkeypatch):
    rows = {name: measured(name, monkeypatch) for name in ("ar", "linear")}
    st = rows["linear"]["step_stats"]
    n_target = sum(1 for step in st["target_fed"] for e in step if e[1] != 0)  # decode forwards
    n_draft = sum(1 for step in st["draft_fed"] for e in step if e[1] != 0)
    iterations = len(st["accepted"]) - 1  # Steps after the prefill's token
    drafted, accepted = sum(st["drafted"][1:]), sum(st["accepted"][1:])
    assert iterations > 2 and 0 < accepted < drafted  # drafts both accepted and rejected: the formulas are exercised
    wall = 0.5 + 0.1 * n_target + 0.3 + 0.02 * n_draft
    assert rows["linear"]["total_s"] == pytest.approx(wall)
    assert st["forward_s"]["draft_prefill"] == pytest.approx(0.3) and st["forward_s"]["target_prefill"] == 0.5

    sums = {
        i: explain.cell_sums([(r["total_s"], {**r["step_stats"], "step_tokens_n": r["step_tokens"][1:]})])
        for i, r in enumerate(rows.values())
    }
    table = pd.DataFrame(
        {
            "cell_id": [0, 1],
            "dataset": "d",
            "l_max": 8,
            "gen_length": T,
            "batch_size": 1,
            "label": ["ar", "linear"],
            "decoder": ["ar", "linear"],
            "family": ["ar", "chain"],
            "speedup": [1.0, rows["ar"]["total_s"] / wall],
        }
    )
    why = explain.explain(table, sums).set_index("label")
    lin = why.loc["linear"]
    assert lin["time_target_share"] == pytest.approx((0.5 + 0.1 * n_target) / wall)
    assert lin["time_draft_share"] == pytest.approx(0.02 * n_draft / wall)
    assert lin["time_draft_prefill_share"] == pytest.approx(0.3 / wall)
    assert lin["time_other_share"] == pytest.approx(0.0, abs=1e-12)
    assert lin["target_forward_ms"] == pytest.approx(100.0) and lin["draft_forward_ms"] == pytest.approx(20.0)
    assert why.loc["ar", "target_forward_ms"] == pytest.approx(100.0)
    assert lin["draft_target_cost"] == pytest.approx(0.2)
    tau = (T - 1) / iterations  # committed tokens per verification, the prefill's token apart
    assert lin["forwards_allow_speedup"] == pytest.approx(tau * 0.1 / ((0.1 * n_target + 0.02 * n_draft) / iterations))
    alpha, k = accepted / drafted, max(st["drafted"])  # K: the longest chain drafted
    assert lin["leviathan_bound"] == pytest.approx((1 - alpha ** (k + 1)) / ((1 - alpha) * (k * 0.2 + 1)))
    # the pricing model on the cell's own forwards: one verification of K + 1 tokens per iteration at its measured
    # 100 ms, the drafted tokens at their measured seconds (the same Pricer as every prediction)
    draft_per_iteration = 0.02 * n_draft / iterations
    assert lin["attainable_speedup"] == pytest.approx(tau * 0.1 / (0.1 + draft_per_iteration))
    priced = Pricer(MeasuredCosts(0.1, 0.1, draft_per_iteration / (drafted / iterations)))
    assert lin["attainable_speedup"] == pytest.approx(priced.chain_speedup(tau, drafted / iterations, None))
    if n_target == iterations:  # one verification per iteration: the model is what was measured
        assert lin["attainable_speedup"] == pytest.approx(lin["forwards_allow_speedup"])
    assert all(math.isnan(why.loc["ar", c]) for c in ("time_target_share", "forwards_allow_speedup"))
    (line,) = explain.note(lin.rename(None).to_frame().T.assign(label="linear").iloc[0])
    assert line.startswith(f"linear: time in target forwards {lin['time_target_share']:.0%}, draft ")
    assert f"its decode forwards and acceptance allow {lin['forwards_allow_speedup']:.2f}x" in line
    assert f"measured {lin['speedup']:.2f}x" in line and "a draft forward costs 0.20 of AR's" in line


def test_the_chain_formula_by_hand():
    """Leviathan et al. 2023, eq. 1 / Section 3.4: alpha = 0.8, K = 4, c = 0.05 -> (1 - 0.8^5) / (0.2 * 1.2);
    alpha = 1: (K + 1) / (K c + 1)."""
    assert explain.leviathan_bound(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / (0.2 * 1.2))
    assert explain.leviathan_bound(1.0, 4, 0.05) == pytest.approx(5 / 1.2)


def test_cells_stored_before_the_prefill_split_get_no_explanation():
    """An old sample's forward seconds have no ``target_prefill``: no explanation (its report stays as it was)."""
    old = {"forward_s": {"target": 1.0, "draft": 0.5}, "accepted": [0, 2], "drafted": [0, 3], "target_fed": []}
    assert explain.cell_sums([(2.0, old)]) is None
    assert explain.cell_sums([]) is None


def test_cost_model_report_explains_each_cell_and_the_calibration_takes_over(tmp_path, monkeypatch):
    """``dtbench report --cost-model`` carries each speculative cell's explanation (issue 58 item 2: "in full in JSON
    and CSV and --cost-model"): the default report's numbers in its JSON, the default report's note line in its notes,
    followed by the calibrated prediction, which takes over. Calibrated with the fake clock's own costs, the
    prediction is the measured time (efficiency 1.00)."""
    import json

    from kit import invoke
    from reportdb import add_cell, add_run

    from dtbench.harness.calibration import calibrate_run
    from dtbench.harness.calibration.calibrate import Point
    from dtbench.harness.store import db

    path = tmp_path / "r.db"
    sessions = db.connect(f"sqlite:///{path}")
    with sessions() as s:
        run = add_run(s)
        for name in ("ar", "linear"):
            cell = add_cell(s, run, name, params={"k": 3} if name == "linear" else {}, l_max=len(PROMPT), T=T)
            s.add(db.Sample(cell_id=cell.id, **measured(name, monkeypatch)))
        s.commit()
        rid = run.id
    points = [  # every forward costs what the fake clock charges: a prefill from an empty cache, else a decode
        Point(role, "m", "float32", len(PROMPT), cache, n, mask, last, COST[(role, cache == 0)], 0.0, 3)
        for role in ("target", "draft")
        for cache in (0, 1, 256)
        for n in (1, 2, 4, 8, 16, 32)
        for mask, last in ((False, False), (True, False), (False, True))
    ]
    calibrate_run.store(sessions, points, run_id=rid, suite_name="t", suite_hash="h" * 64, device=torch.device("cpu"))

    default = json.loads(invoke("report", "--db", str(path), "--format", "json").output)["cells"]
    cost = invoke("report", "--db", str(path), "--cost-model", "--format", "json")
    assert cost.exit_code == 0, cost.output
    cells = {c["label"]: c for c in json.loads(cost.stdout)["cells"]}
    lin = next(c for c in default if c["label"] == "linear")
    assert lin["time_target_share"] > 0.5 and lin["forwards_allow_speedup"] > 0  # explained in the default report
    for col in explain.COLUMNS:  # the same numbers in both reports (one computation)
        assert cells["linear"][col] == pytest.approx(lin[col]), col
    assert cells["linear"]["efficiency"] == pytest.approx(1.0)  # the calibrated prediction: the measured time

    shown = invoke("report", "--db", str(path), "--cost-model", "--format", "markdown").output.splitlines()
    note = next(line for line in shown if "time in target forwards" in line)  # the linear cell's; AR has none
    assert f"linear: time in target forwards {lin['time_target_share']:.0%}, draft " in note
    assert f"its decode forwards and acceptance allow {lin['forwards_allow_speedup']:.2f}x" in note
    assert f"measured {cells['linear']['measured_speedup']:.2f}x" in note
    predicted = cells["linear"]["predicted_speedup"]
    assert note.rstrip().endswith(f"calibrated: predicted {predicted:.2f}x, efficiency 1.00 (takes over)")
    assert sum("time in target forwards" in line for line in shown) == 1
