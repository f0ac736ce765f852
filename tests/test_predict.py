"""Will it pay on my GPU? (issue 48): portable curves files and ``dtbench report --predict-on``.

A fake machine makes the check exact: the one clock (``dtbench.decoders.base.clock``) advances only inside model
forwards, by a deterministic cost per forward (role, tokens fed, mask flags), so a run's measured time is exactly
the cost of the forwards it ran and a calibration measures exactly that cost. Two such machines differ in their
costs ("A", this CPU, and "B", the device). The acceptance half comes from a run on A, the timing half from a
calibration on B; the prediction must equal what the same suite measured on B.
"""

from __future__ import annotations

import json
import math

import pytest
from kit import fast_calibration_settings, invoke, suite_dict, tiny_pair, write_suite

from dtbench.decoders import base as decoder_base
from dtbench.harness.calibration import calibrate_run, curves_file
from dtbench.harness.calibration.curves import FED_LAST, FED_MASK
from dtbench.harness.models import loading as models

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")

DECODERS = [{"name": "ar"}, {"name": "linear", "params": {"k": 3}}, {"name": "dynatree", "params": {"n_max": 8}}]
# seconds: (per forward, per token fed) by role; a prefill pays per token only, a tree mask and last-only logits
# shift the per-forward cost (the calibration measures every kind on its own curve)
MACHINES = {
    "A": {"target": (0.020, 0.0010), "draft": (0.012, 0.0004)},
    "B": {"target": (0.004, 0.00002), "draft": (0.0015, 0.00001)},  # bandwidth-bound: a wide tree costs little
}


class FakeMachine:
    """The one clock, advanced inside forwards only, by the machine's cost of each forward."""

    def __init__(self, costs: dict[str, tuple[float, float]]):
        self.costs, self.t, self.handles = costs, 1000.0, []

    def clock(self) -> float:
        return self.t

    def cost(self, role: str, n: int, past: int | None, flags: int) -> float:
        per_forward, per_token = self.costs[role]
        if not past:
            return per_token * n
        extra = 0.001 if flags & FED_MASK else -0.0005 if flags & FED_LAST else 0.0
        return per_forward + extra + per_token * n

    def attach(self, model, role: str) -> None:
        from dtbench.harness.measurement import forwards

        pending: list[float] = []

        def pre(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            past = forwards.past_length(forwards.cache_argument(kwargs))
            pending.append(self.cost(role, int(ids.shape[-1]), past, forwards.fed_flags(kwargs)))

        def post(module, args, kwargs, output):
            self.t += pending.pop()

        self.handles.append(model.register_forward_pre_hook(pre, with_kwargs=True))
        self.handles.append(model.register_forward_hook(post, with_kwargs=True, always_call=True))


@pytest.fixture
def machines(monkeypatch, tmp_path):
    """``use(name)``: from now on the clock and every model loaded run on machine ``name``."""
    import dtbench.cli.main  # noqa: F401  (imported before Settings is patched: its options read the defaults)

    monkeypatch.setattr(calibrate_run, "Settings", fast_calibration_settings())
    target_dir, draft_dir = tiny_pair(tmp_path)
    state: dict = {}
    load = models.load_model

    def loading(spec, device):
        loaded = load(spec, device)
        state["machine"].attach(loaded.model, "target" if spec.model == str(target_dir) else "draft")
        return loaded

    def use(name: str) -> None:
        state["machine"] = FakeMachine(MACHINES[name])
        monkeypatch.setattr(decoder_base, "clock", state["machine"].clock)

    monkeypatch.setattr(models, "load_model", loading)
    use.pair = (target_dir, draft_dir)  # type: ignore[attr-defined]
    return use


def _run(tmp_path, data_dir, use, db: str, calibrate: bool) -> None:
    target, draft = use.pair
    suite = suite_dict(target, draft, DECODERS, calibrate=calibrate, isolation="none")
    suite["generation_lengths"] = [12]
    path = write_suite(tmp_path, suite, f"{db}.yaml")
    result = invoke(
        "run", path, "--db", str(tmp_path / db), "--data-dir", str(data_dir), "--no-progress", "--no-report"
    )
    assert result.exit_code == 0, result.output


def _report(*args: str) -> dict:
    result = invoke("report", *args, "--format", "json")
    assert result.exit_code == 0, result.output
    return {c["label"]: c for c in json.loads(result.output)["cells"]}


@pytest.mark.full  # two end-to-end runs
def test_acceptance_here_timing_there_predicts_what_there_measures(machines, tmp_path, data_dir):
    """Two stored runs and a curves file from a third: a run "here" on machine A (acceptance traces), curves exported
    from a calibrated run on machine B, and a run "there" on B. The prediction of the first run on the curves equals,
    to 1e-6 (the stated error: the fake machines are exact), what the run on B measured (same prompts, same greedy
    tokens, so the same forwards), per cell in throughput and speedup."""
    machines("A")
    _run(tmp_path, data_dir, machines, "here.db", calibrate=False)
    machines("B")
    _run(tmp_path, data_dir, machines, "calibrated.db", calibrate=True)  # the third run: only its curves are used
    _run(tmp_path, data_dir, machines, "there.db", calibrate=False)
    curves = tmp_path / "b.json"
    result = invoke("report", "--db", str(tmp_path / "calibrated.db"), "--export-curves", str(curves))
    assert result.exit_code == 0, result.output
    pc = curves_file.read(curves)
    assert pc.models["target"]["shape"]["hidden_size"] == 16 and pc.execution == "eager"
    assert all(v == pytest.approx(0.0, abs=1e-9) for v in pc.overhead_s.values())  # no time outside forwards
    predicted = _report("--db", str(tmp_path / "here.db"), "--predict-on", str(curves))
    measured_there = _report("--db", str(tmp_path / "there.db"))
    here = _report("--db", str(tmp_path / "here.db"))
    assert set(predicted) == {"ar", "linear", "dynatree"}
    for label, p in predicted.items():
        assert p["predicted_throughput"] == pytest.approx(measured_there[label]["throughput_mean"], rel=1e-6)
        assert p["measured_throughput"] == pytest.approx(here[label]["throughput_mean"], rel=1e-6)
    speedup = {k: p["predicted_speedup"] for k, p in predicted.items()}
    assert speedup["ar"] == pytest.approx(1.0)
    for label in ("linear", "dynatree"):
        there = measured_there[label]["throughput_mean"] / measured_there["ar"]["throughput_mean"]
        assert speedup[label] == pytest.approx(there, rel=1e-6)
        assert not math.isclose(speedup[label], predicted[label]["measured_speedup"], rel_tol=0.05)  # A and B differ
    figs = tmp_path / "figs"
    result = invoke("report", "--db", str(tmp_path / "here.db"), "--predict-on", str(curves), "--figures", str(figs))
    assert result.exit_code == 0, result.output
    assert (figs / "predicted_speedup.png").is_file()


def test_a_shape_mismatch_and_a_broken_file_are_refused_in_one_line(machines, tmp_path, data_dir):
    machines("A")
    _run(tmp_path, data_dir, machines, "r.db", calibrate=True)
    curves = tmp_path / "c.json"
    assert invoke("report", "--db", str(tmp_path / "r.db"), "--export-curves", str(curves)).exit_code == 0
    assert _report("--db", str(tmp_path / "r.db"), "--predict-on", str(curves))["linear"]["predicted_s"] > 0
    doc = json.loads(curves.read_text())
    doc["models"]["target"]["shape"]["hidden_size"] = 2560
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(doc))
    result = invoke("report", "--db", str(tmp_path / "r.db"), "--predict-on", str(wrong))
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "across model shapes is refused" in lines[0] and "Traceback" not in result.output
    assert "llama 1 layers x 2560" in lines[0]
    for text, why in (("{", "not JSON"), ('{"format": "x"}', "not a dtbench curves file")):
        wrong.write_text(text)
        result = invoke("report", "--db", str(tmp_path / "r.db"), "--predict-on", str(wrong))
        assert result.exit_code == 2 and why in result.output and len(result.output.strip().splitlines()) == 1


def test_shape_rule():
    a = {"target": {"shape": {"model_type": "gpt_neox", "hidden_size": 2560}, "params": 2}}
    assert curves_file.shape_mismatch(a, {"target": {"shape": {"model_type": "gpt_neox", "hidden_size": 2560}}}) is None
    assert "refused" in curves_file.shape_mismatch(
        a, {"target": {"shape": {"model_type": "llama", "hidden_size": 2560}}}
    )
    assert curves_file.shape_mismatch(a, {"target": {"params": 2}}) is None  # an old run: parameter counts
    assert "no draft" in curves_file.shape_mismatch(a, {"target": {"params": 2}, "draft": {"params": 1}})
    assert curves_file.shape_mismatch(a, {"target": {"params": 2}, "draft": None}) is None
