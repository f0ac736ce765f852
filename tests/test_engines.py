"""Issue 40 items 2 and 3: serving engines are adapters looked up by name (built-ins and a plugin's, one class and one
entry point), never branched on; a server's request becomes a row through the one row builder; one tie rule."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
from kit import install_plugin, invoke, one_line_error, write_suite

from dtbench.decoders.engines import engine_for, engine_names, load_engine_plugins, schedule_engines
from dtbench.decoders.server import ServerParams, parse_chunk, request_body
from dtbench.harness.data.prompt import Prompt
from dtbench.harness.measurement.observation import Served, sample_row

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

MY_ENGINE = """
from dtbench.api import OpenAICompatible


class MyEngine(OpenAICompatible):
    schedules = True

    def stream_fields(self, stop_at_eos):
        return {"my_ignore_eos": not stop_at_eos}

    def read(self, event, choice, chunk):
        if "my_ids" in choice:
            chunk.tokens = list(choice["my_ids"])
        if "my_steps" in event:
            chunk.counters["my:steps"] = float(event["my_steps"])

    def acceptance(self, counters, new_tokens):
        if "my:steps" not in counters:
            return {}
        steps = int(counters["my:steps"])
        return {"source": "my", "drafted": None, "accepted": new_tokens - steps, "steps": steps,
                "acceptance_length": new_tokens / steps, "steps_rule": "reported"}

    def schedule(self, spans):
        return {"k_by_batch": {hi: k for _, hi, k in spans}}
"""


def _install(monkeypatch, root, dist: str, names: dict[str, str], source: str) -> None:
    """A one-module distribution registering ``names`` under the ``dtbench.engines`` entry-point group."""
    install_plugin(monkeypatch, root, dist, names, source, group="dtbench.engines")


def test_the_builtin_engines_are_registered_as_a_plugins_would_be():
    builtin = ("llama.cpp", "openai", "sglang", "trtllm", "vllm")  # pyproject's entry points, sorted by name
    assert engine_names()[:5] == builtin
    declared = {ep.name for ep in entry_points(group="dtbench.engines") if ep.dist and ep.dist.name == "dtbench"}
    assert declared == set(builtin)  # pyproject.toml declares each under dtbench.engines
    assert schedule_engines() == ("sglang", "trtllm", "vllm")  # the --schedule choices: adapters that state one
    assert [n for n in builtin if engine_for(n).metrics_path] == ["vllm"]  # who has a counters endpoint: an attribute


def test_a_plugin_engine_is_one_class_and_one_entry_point(monkeypatch, tmp_path):
    _install(monkeypatch, tmp_path / "site", "dtbench-myengine", {"my-engine": "dtbench_myengine:MyEngine"}, MY_ENGINE)
    params = ServerParams(base_url="http://127.0.0.1:1", engine="my-engine", extra_body={"x": 1})
    body = request_body(params, [1, 2], 4, stop_at_eos=False)
    assert body["my_ignore_eos"] is True and body["x"] == 1 and body["max_tokens"] == 4 and body["stream"] is True
    chunk = parse_chunk("my-engine", {"choices": [{"text": "ab", "my_ids": [7, 8]}], "my_steps": 2})
    assert chunk.tokens == [7, 8] and chunk.text == "ab"
    assert engine_for("my-engine").acceptance(chunk.counters, 4)["steps"] == 2
    assert "my-engine" in engine_names() and "my-engine" in schedule_engines()
    from dtbench.reports.pricing.schedule import engine_config

    assert engine_config("my-engine", [(1, 2, 3), (4, 4, 0)]) == {"k_by_batch": {2: 3, 4: 0}}


def test_a_plugin_cannot_take_a_builtin_engines_name(monkeypatch, tmp_path):
    source = "class Fake:\n    pass\n"
    _install(monkeypatch, tmp_path / "site", "dtbench-fakevllm", {"vllm": "dtbench_fakevllm:Fake"}, source)
    problems = load_engine_plugins()
    assert any("refused" in p and "dtbench-fakevllm" in p for p in problems)
    assert type(engine_for("vllm")).__module__ == "dtbench.decoders.engines.vllm"


def test_an_unknown_engine_is_one_line_at_validation(tmp_path):
    with pytest.raises(ValueError, match="unknown engine 'vlm'; did you mean 'vllm'"):
        ServerParams(base_url="http://127.0.0.1:1", engine="vlm")
    suite = {
        "name": "e",
        "seed": 0,
        "target": {"model": "smollm2-135m", "dtype": "float32"},
        "datasets": [{"name": "wikitext-2", "prompts": 2, "warmup": 0, "L_max": 16}],
        "generation_lengths": [4],
        "decoders": [{"name": "server", "params": {"base_url": "http://127.0.0.1:1", "engine": "vlm"}}],
    }
    one_line_error(invoke("validate", write_suite(tmp_path, suite)), "params.engine", "unknown engine 'vlm'")


def test_a_served_request_is_a_row_of_the_one_row_builder():
    served = Served(
        tokens=[5, 6, 7, 8],
        step_times=[0.1, 0.2, 0.5],
        step_tokens=[2, 1, 1],
        drafted=6,
        accepted=3,
        steps=2,
        stats={"server": {"engine": "llama.cpp"}},
    )
    row = sample_row(served, Prompt(3, "doc", (1, 2, 3)), False, [5, 6, 9, 8])
    assert row["iterations"] == 3 and row["tokens_per_iteration"] == pytest.approx(4 / 3)  # iterations: reads
    assert row["total_s"] == 0.5 and row["ttft_s"] == 0.1 and row["tpot_s"] == pytest.approx(0.4 / 3)
    assert row["throughput"] == pytest.approx(8.0) and row["step_tokens"] == [2, 1, 1]
    assert (row["drafted"], row["accepted"], row["draft_depth"]) == (6, 3, 6) and row["acceptance_rate"] == 0.5
    assert row["mean_path_length"] == 1.5 and row["acceptance_incl_bonus"] is None and row["target_forwards"] is None
    assert row["first_divergence"] == 2 and row["lossless"] is False and row["step_stats"] == served.stats
    assert "peak_rss_bytes" not in row and "energy_j" not in row  # a server's memory and energy are not dtbench's


def test_one_tie_rule_decides_both_lossless_checks(monkeypatch):
    import torch

    from dtbench.harness.measurement import lossless
    from dtbench.harness.serving import check_request

    params = ServerParams(base_url="http://127.0.0.1:1", tie_margin=0.01)
    shapes = ([(7, -0.1), (9, -2.0)], [(7, -0.1), (9, -2.0)])  # 9 is 1.9 below 7: an error under the rule
    inc = torch.tensor([0.0, 3.0, 1.0], dtype=torch.float64)  # token 2 is 2.0 below the top: an error
    assert check_request([5, 9], [5, 7], lambda i: shapes, params, "tie_aware")["lossless_errors"] == 1
    assert lossless.classify(2, inc, inc.clone())[0] == "error"
    monkeypatch.setattr(lossless, "tie_or_error", lambda *a, **k: "tie")  # change the one rule: both checks follow
    assert check_request([5, 9], [5, 7], lambda i: shapes, params, "tie_aware")["lossless_ties"] == 1
    assert lossless.classify(2, inc, inc.clone())[0] == "tie"
