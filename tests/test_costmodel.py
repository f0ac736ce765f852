"""The cost model (issue 12): calibration, per-forward records, predictions, the report and n_max: auto.

The exactness tests replace the clock by a fake one that advances only inside model forwards, by a deterministic
cost f(role, kind, n): then a decoder's measured time is exactly the cost of the forwards it ran, and the cost
model's prediction from the calibration must equal it for every built-in decoder.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit import fast_calibration_settings
from models import examples, model_zoo

from dtbench.decoders import base as decoder_base
from dtbench.decoders.tree import N_MAX_AUTO_CEILING
from dtbench.harness import registry
from dtbench.harness.calibration import calibrate as cal
from dtbench.harness.calibration import calibrate_run
from dtbench.harness.calibration import curves as curves_mod
from dtbench.harness.measurement import forwards, machine, measure
from dtbench.harness.measurement.observation import sample_row
from dtbench.harness.models.loading import LoadedModel
from dtbench.harness.suites.plan import plan_suite
from dtbench.harness.suites.suitefile import parse_suite
from dtbench.reports.pricing import costmodel, pricing
from dtbench.testing.fixtures import VOCAB

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")

# --- a fake machine: forward costs by (role, kind, n) ---------------------------------------------------------------


class FakeCost:
    """f(role, kind, n) seconds: arbitrary values for n <= 4, then linear (so the calibrated grids, which hold every
    n <= 4 and at least one more point, interpolate and extrapolate it exactly); prefills a + b n."""

    def __init__(self, table: dict[tuple[str, str], tuple[list[float], float]]):
        self.table = table

    @staticmethod
    def kind(past, flags) -> str:
        if past == 0:
            return "prefill"
        return "tree" if flags & measure.FED_MASK else "last" if flags & measure.FED_LAST else "causal"

    def __call__(self, role: str, n: int, past, flags: int) -> float:
        values, slope = self.table[(role, self.kind(past, flags))]
        if self.kind(past, flags) == "prefill":
            return values[0] + slope * n
        return values[n - 1] if n <= 4 else values[3] + slope * (n - 4)


def cost_tables():
    seconds = st.floats(0.001, 0.1, allow_nan=False, allow_infinity=False)
    key = st.tuples(st.lists(seconds, min_size=4, max_size=4), st.floats(0.0, 0.01))
    return st.fixed_dictionaries(
        {(r, k): key for r in ("target", "draft") for k in ("prefill", "causal", "tree", "last")}
    )


class FakeClock:
    """A clock that moves only when a hooked model runs a forward (by the fake cost of that forward, charged when the
    forward returns, so the runner's own forward timer, whose hooks wrap the forward, sees it)."""

    def __init__(self, cost: FakeCost):
        self.t = 0.0
        self.cost = cost
        self.handles = []

    def now(self) -> float:
        return self.t

    def attach(self, model, role: str) -> None:
        pending = []

        def pre_hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            past = forwards.past_length(forwards.cache_argument(kwargs))
            pending.append(self.cost(role, int(ids.shape[-1]), past, forwards.fed_flags(kwargs)))

        def post_hook(module, args, kwargs, output):
            self.t += pending.pop()

        self.handles.append(model.register_forward_pre_hook(pre_hook, with_kwargs=True))
        self.handles.append(model.register_forward_hook(post_hook, with_kwargs=True, always_call=True))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


Fast = fast_calibration_settings()  # one forward per point


FAST = Fast()

DECODERS = {
    "ar": st.just({}),
    "hf_generate": st.just({}),
    "linear": st.fixed_dictionaries({"k": st.integers(1, 6)}),
    "fixed_tree": st.fixed_dictionaries(
        {
            "depth": st.integers(1, 4),
            "branching": st.integers(1, 3),
            "n_max": st.integers(1, 24),
            "cache_strategy": st.sampled_from(["compact", "rebuild"]),
            "draft_strategy": st.sampled_from(["per_level", "per_node"]),
            "tau": st.sampled_from([0.0, 0.1]),
        }
    ),
    "dynatree": st.fixed_dictionaries(
        {
            "n_max": st.integers(1, 32),
            "cache_strategy": st.sampled_from(["compact", "rebuild"]),
            "draft_strategy": st.sampled_from(["per_level", "per_node"]),
            "tau": st.sampled_from([0.0, 0.1]),
        }
    ),
    "hf_assisted": st.fixed_dictionaries({"num_assistant_tokens": st.integers(1, 6)}),
    "streaming_ar": st.fixed_dictionaries({"sinks": st.integers(0, 2), "window": st.integers(3, 9)}),
    "streaming_spec": st.fixed_dictionaries(
        {"sinks": st.integers(0, 2), "window": st.integers(3, 9), "k": st.integers(1, 4)}
    ),
}


def tiny_suite(name: str, params: dict, l_max: int, T: int):
    text = yaml.safe_dump(
        {
            "name": "fake",
            "device": "cpu",
            "target": {"model": "t", "dtype": "float64"},
            "draft": {"model": "d", "dtype": "float64"},
            "datasets": [{"name": "wikitext-2", "prompts": 2, "warmup": 1, "L_max": l_max}],
            "generation_lengths": [T],
            "decoders": [{"name": name, "params": params}],
        }
    )
    suite = parse_suite(text)
    return suite, plan_suite(suite)


def grid_curves(cost: FakeCost, suite, plan) -> curves_mod.Curves:
    """The curves calibrate() would measure under ``cost``, built directly on the same grid (fast)."""
    points = []
    for c in cal.curves_for(plan, suite, True):
        for n in c.ns:
            flags = (measure.FED_MASK if c.tree_mask else 0) | (measure.FED_LAST if c.last_only else 0)
            points.append(
                cal.Point(
                    c.role,
                    "m",
                    "float64",
                    c.prompt_len,
                    c.cache_len,
                    n,
                    c.tree_mask,
                    c.last_only,
                    cost(c.role, n, c.cache_len, flags),
                    0.0,
                    1,
                )
            )
    return curves_mod.Curves(points)


def test_fed_flags_agree():
    assert (curves_mod.FED_MASK, curves_mod.FED_LAST) == (measure.FED_MASK, measure.FED_LAST)


def test_calibrate_with_fake_clock_measures_the_cost_exactly():
    """calibrate() itself, clocked by the fake clock: every point's median is the fake cost of that forward."""
    target, draft = model_zoo()["perturbed"]
    cost = FakeCost(
        {
            (r, k): ([0.01, 0.03, 0.025, 0.02], 0.001)
            for r in ("target", "draft")
            for k in ("prefill", "causal", "tree", "last")
        }
    )
    clock = FakeClock(cost)
    clock.attach(target, "target")
    clock.attach(draft, "draft")
    suite, plan = tiny_suite("dynatree", {"n_max": 20}, 12, 6)
    try:
        points = cal.calibrate(
            plan,
            suite,
            LoadedModel(target, "t", "float64", "cpu", 0),
            LoadedModel(draft, "d", "float64", "cpu", 0),
            torch.device("cpu"),
            {12: list(range(3, 15))},
            settings=FAST,
            clock=clock.now,
        )
    finally:
        clock.detach()
    kinds = {
        (p.role, "prefill" if p.cache_len == 0 else "tree" if p.tree_mask else "last" if p.last_only else "causal")
        for p in points
    }
    assert kinds == {(r, k) for r in ("target", "draft") for k in ("prefill", "causal", "tree", "last")}
    assert {p.cache_len for p in points} == {0, 12, 18}
    for p in points:
        flags = (measure.FED_MASK if p.tree_mask else 0) | (measure.FED_LAST if p.last_only else 0)
        assert p.median_s == pytest.approx(cost(p.role, p.n, p.cache_len, flags), rel=1e-9)
        assert p.repeats == 1
    assert max(p.n for p in points if p.tree_mask) == 21  # root + n_max


@settings(
    max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(data=st.data(), table=cost_tables())
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_predictions_are_exact_for_every_builtin_decoder(name, data, table):
    """Measured under the fake clock, each sample's predicted time equals its measured time."""
    params = data.draw(DECODERS[name], label="params")
    T = data.draw(st.integers(2, 12), label="T")
    prompt = data.draw(st.lists(st.integers(3, VOCAB - 1), min_size=8, max_size=20), label="prompt")
    target, draft = model_zoo()["perturbed"]
    cost = FakeCost(table)
    suite, plan = tiny_suite(name, params, len(prompt), T)
    curves = grid_curves(cost, suite, plan)
    cls, p = registry.get(name), registry.validate_params(name, params)
    decoder = cls(target, draft if cls.needs_draft else None, p)
    clock = FakeClock(cost)
    clock.attach(target, "target")
    clock.attach(draft, "draft")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(decoder_base, "clock", clock.now)  # the one clock: the loop, the forward timer, Step.at
            m = measure.measure(decoder, prompt, T, torch.device("cpu"))
    finally:
        clock.detach()
    row = sample_row(m, type("P", (), {"index": 0, "document": "", "token_ids": prompt})(), False, None)
    priced = pricing.price_sample(curves, json.loads(json.dumps(row["step_stats"])))
    assert not priced.approx
    assert priced.predicted_s == pytest.approx(row["total_s"], rel=1e-9, abs=1e-12)
    # the runner's forward timer sees exactly the clock's movement: all of it happens inside forwards
    timed = row["step_stats"]["forward_s"]
    assert timed["target"] + (timed["draft"] or 0.0) == pytest.approx(row["total_s"], rel=1e-9, abs=1e-12)
    assert timed["target"] == pytest.approx(priced.target_s, rel=1e-9, abs=1e-12)
    if not cls.needs_draft:
        assert priced.draft_s == 0


@settings(max_examples=examples(40), deadline=None)
@given(
    table=cost_tables(),
    steps=st.lists(
        st.lists(
            st.tuples(
                st.sampled_from(["target", "draft"]),
                st.integers(1, 300),
                st.sampled_from([0, 16, 40, 64]),
                st.sampled_from([0, 1, 2, 3]),
            ),
            max_size=6,
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_price_of_random_step_sequences_is_the_sum_of_forward_costs(table, steps):
    """Any sequence of steps and forwards: the predicted time is the fake cost of each forward, summed."""
    cost = FakeCost(table)
    suite, plan = tiny_suite("dynatree", {"n_max": 256}, 16, 48)  # curves at cache 16 and 64, n up to 257
    curves = grid_curves(cost, suite, plan)
    stats = {"target_fed": [], "draft_fed": []}
    expected = {"target": 0.0, "draft": 0.0}
    for step_forwards in steps:
        for role in ("target", "draft"):
            mine = [[n, past, flags] for r, n, past, flags in step_forwards if r == role]
            stats[f"{role}_fed"].append(mine)
            expected[role] += sum(cost(role, n, past, flags) for n, past, flags in mine)
    priced = pricing.price_sample(curves, stats)
    assert priced.target_s == pytest.approx(expected["target"], rel=1e-9, abs=1e-12)
    assert priced.draft_s == pytest.approx(expected["draft"], rel=1e-9, abs=1e-12)


def test_old_samples_without_per_forward_records_are_priced_approximately():
    cost = FakeCost(
        {
            (r, k): ([0.01, 0.02, 0.03, 0.04], 0.01)
            for r in ("target", "draft")
            for k in ("prefill", "causal", "tree", "last")
        }
    )
    suite, plan = tiny_suite("linear", {"k": 3}, 16, 8)
    curves = grid_curves(cost, suite, plan)
    priced = pricing.price_sample(
        curves, {"target_forwards": [1, 1], "target_tokens": [4, 4], "draft_forwards": None, "draft_tokens": None}
    )
    assert priced.approx and priced.draft_s == 0
    assert priced.target_s == pytest.approx(2 * 0.04)


# --- chain decoders: per-position acceptance and the best K ---------------------------------------------------------


def test_position_acceptance_counts_only_drafted_positions():
    # K=3 drafted in 4 iterations: accepted 3, 1, 0, 2; a final truncated iteration drafted 1 and accepted it.
    p = pricing.position_acceptance([3, 1, 0, 2, 1], [3, 3, 3, 3, 1])
    assert p == pytest.approx([4 / 5, 2 / 3, 1 / 2])
    assert pricing.expected_tokens(p, 0) == 1
    assert pricing.expected_tokens(p, 2) == pytest.approx(1 + 0.8 + 0.8 * 2 / 3)


def test_best_k_from_costs():
    """Draft steps cost a tenth of a target step, verification is flat: with p = 0.9 everywhere, longer is better
    up to where E(k) saturates against k draft steps."""
    pts = []
    for role in ("target", "draft"):
        for _kind, mask, last in (("causal", False, False), ("last", False, True)):
            for n in range(1, 17):
                pts.append(cal.Point(role, "m", "f", 100, 100, n, mask, last, 0.1 if role == "target" else 0.01, 0, 1))
    curves = curves_mod.Curves(pts)
    speed = pricing.chain_speedups(curves, [0.9] * 10, 100)
    for k, s in speed.items():
        assert s == pytest.approx(0.1 * pricing.expected_tokens([0.9] * 10, k) / (k * 0.01 + 0.1))
    best = max(speed, key=speed.get)
    assert 1 < best <= 10


# --- the database and the report ------------------------------------------------------------------------------------


def test_calibration_round_trips_through_the_database(tmp_path):
    from reportdb import add_run

    from dtbench.harness.store import db

    sessions = db.connect(f"sqlite:///{tmp_path / 'r.db'}")
    points = [
        cal.Point("target", "smollm2-135m", "float32", 128, c, n, mask, last, 0.001 * n + c * 1e-5, 1e-4, 7)
        for c in (0, 128, 192)
        for n in (1, 2, 8, 64)
        for mask, last in ((False, False), (True, False))
    ]
    with sessions() as s:
        run = add_run(
            s,
            env={
                "device": "cpu",
                "device_name": machine.device_name(torch.device("cpu")),
                "target": {"model": "smollm2-135m", "dtype": "float32"},
                "draft": None,
            },
        )
        other = add_run(
            s,
            env={
                "device": "cpu",
                "device_name": "another cpu",
                "target": {"model": "smollm2-135m", "dtype": "float32"},
            },
        )
        s.commit()
        rid, oid = run.id, other.id
    batch = calibrate_run.store(
        sessions, points, run_id=None, suite_name="q", suite_hash="h" * 64, device=torch.device("cpu")
    )
    with sessions() as s:
        rows = s.query(db.Calibration).order_by(db.Calibration.id).all()
        assert [
            (
                r.role,
                r.model,
                r.dtype,
                r.prompt_len,
                r.cache_len,
                r.n,
                r.tree_mask,
                r.last_only,
                r.median_s,
                r.iqr_s,
                r.repeats,
            )
            for r in rows
        ] == [
            (
                p.role,
                p.model,
                p.dtype,
                p.prompt_len,
                p.cache_len,
                p.n,
                p.tree_mask,
                p.last_only,
                p.median_s,
                p.iqr_s,
                p.repeats,
            )
            for p in points
        ]
        assert {r.batch for r in rows} == {batch} and all(r.run_id is None for r in rows)
        curves = curves_mod.load_curves(s, s.get(db.Run, rid))  # standalone, matched by model, dtype, device
        assert curves is not None and curves.batch == batch and curves.run_id is None
        assert curves.cost("target", 8, 128, measure.FED_MASK) == pytest.approx(0.008 + 128e-5)
        assert curves.cost("target", 8, 160, 0) == pytest.approx(0.008 + 160e-5)  # between cache lengths
        assert curves.cost("target", 100, 0, 0) == pytest.approx(0.1)  # a prefill, along the last segment
        assert curves_mod.load_curves(s, s.get(db.Run, oid)) is None  # another machine
    linked = calibrate_run.store(
        sessions, points[:4], run_id=oid, suite_name="q", suite_hash="h" * 64, device=torch.device("cpu")
    )
    with sessions() as s:
        curves = curves_mod.load_curves(s, s.get(db.Run, oid))
        assert curves.batch == linked and curves.run_id == oid
        s.delete(s.get(db.Run, oid))
        s.commit()
        assert s.query(db.Calibration).filter_by(batch=linked).count() == 0  # cascades with its run


def test_cost_model_without_calibration_is_a_one_line_error(tmp_path):
    from kit import invoke
    from reportdb import add_cell, add_run, add_samples

    from dtbench.harness.store import db

    path = tmp_path / "r.db"
    sessions = db.connect(f"sqlite:///{path}")
    with sessions() as s:
        run = add_run(s)
        add_samples(s, add_cell(s, run, "ar"), [30.0, 31.0])
        s.commit()
    result = invoke("report", "--db", str(path), "--cost-model")
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "no calibration" in lines[0] and "dtbench calibrate" in lines[0]


def test_auto_budget_takes_the_largest_n_within_the_factor():
    # one token 10 ms; verify with the tree mask: n=2,3 slow (CPU kernels), n up to 9 within 2x, then steep.
    costs = {
        1: 0.010,
        2: 0.025,
        3: 0.024,
        4: 0.012,
        5: 0.013,
        6: 0.014,
        7: 0.015,
        8: 0.016,
        9: 0.019,
        10: 0.021,
        11: 0.022,
        12: 0.023,
        13: 0.024,
        14: 0.025,
        15: 0.026,
        16: 0.027,
    }
    pts = [cal.Point("target", "m", "f", 64, 64, n, True, False, c, 0, 1) for n, c in costs.items()]
    pts += [cal.Point("target", "m", "f", 64, 64, 1, False, False, 0.010, 0, 1)]
    curves = curves_mod.Curves(pts)
    assert curves_mod.auto_budget(curves, 64, 2.0) == 8  # verify of 9 tokens (root + 8) = 19 ms <= 20 ms
    assert curves_mod.auto_budget(curves, 64, 1.05) == 1  # nothing within: at least one node


def test_run_with_calibrate_and_auto_budget(tmp_path, data_dir, monkeypatch):
    """A suite with `calibrate: true` and `n_max: auto`: the calibration is stored with the run, the budget lands in
    the cell's params, and `report --cost-model --format json` prices every cell."""
    from kit import invoke, suite_dict, tiny_pair, write_suite

    import dtbench.cli.main  # noqa: F401  (imported before Settings is patched: its options read the defaults)
    from dtbench.harness.store import db

    monkeypatch.setattr(calibrate_run, "Settings", Fast)
    target, draft = tiny_pair(tmp_path)
    suite = suite_dict(
        target,
        draft,
        [
            {"name": "ar"},
            {"name": "linear", "params": {"k": 3}},
            {"name": "dynatree", "params": {"n_max": "auto", "n_max_factor": 3.0}},
        ],
        calibrate=True,
    )
    dbfile = tmp_path / "r.db"
    result = invoke(
        "run",
        write_suite(tmp_path, suite),
        "--db",
        str(dbfile),
        "--data-dir",
        str(data_dir),
        "--no-progress",
        "--no-report",
    )
    assert result.exit_code == 0, result.output
    sessions = db.connect(f"sqlite:///{dbfile}")
    with sessions() as s:
        run = s.query(db.Run).one()
        assert s.query(db.Calibration).filter_by(run_id=run.id).count() > 0
        where = run.environment["calibration"]  # measured by the local executor's worker: this process
        assert (
            where["pid"] == os.getpid()
            and where["device"] == "cpu"
            and where["batch"] == curves_mod.load_curves(s, run).batch
        )
        cell = s.query(db.Cell).filter_by(decoder="dynatree").one()
        assert isinstance(cell.params["n_max"], int) and 1 <= cell.params["n_max"] <= N_MAX_AUTO_CEILING
    result = invoke("report", "--db", str(dbfile), "--cost-model", "--format", "json")
    assert result.exit_code == 0, result.output
    cells = {c["label"]: c for c in json.loads(result.output)["cells"]}
    assert set(cells) == {"ar", "linear", "dynatree"}
    for c in cells.values():
        assert c["predicted_s"] > 0 and c["measured_s"] > 0
        assert math.isclose(c["efficiency"], c["predicted_s"] / c["measured_s"], rel_tol=1e-9)
        # the time decomposition: share of the measured time inside forwards x calibrated / timed forward cost
        assert 0 < c["forward_share"] <= 1 and c["in_forward_s"] <= c["measured_s"]
        assert math.isclose(c["efficiency"], c["forward_share"] * c["forward_speed"], rel_tol=1e-9)
    assert 1 <= cells["linear"]["predicted_best_k"] <= 3 and cells["linear"]["predicted_best_speedup"] > 0
    assert cells["dynatree"]["predicted_best_k"] is None
    # the same report through the other registered formats: one CSV row per cell (the per-position acceptance as
    # ';'-joined shares, as JSON's list), one HTML page
    rows = list(
        csv.DictReader(io.StringIO(invoke("report", "--db", str(dbfile), "--cost-model", "--format", "csv").stdout))
    )
    assert {r["label"] for r in rows} == set(cells) and "prompt_cap" in rows[0]
    linear = next(r for r in rows if r["label"] == "linear")
    assert [float(x) for x in linear["acceptance_by_position"].split(";")] == pytest.approx(
        cells["linear"]["acceptance_by_position"], abs=1e-6
    )
    page = invoke("report", "--db", str(dbfile), "--cost-model", "--format", "html").stdout
    assert page.startswith("<!DOCTYPE html>") and "cost model" in page and "Best config (pred.)" in page
    result = invoke("report", "--db", str(dbfile), "--figures", str(tmp_path / "figs"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "figs" / f"{costmodel.FIG_STEM}.png").is_file()
