"""Issue 67 ("Nothing runs that nobody asked for, round 7"), the items this stop fixed: `validate` warns when a cell
measures fewer prompts after warmup than an interval needs; `dtbench decoders` shows a default_factory's value, not
pydantic's PydanticUndefined; a bad DTBENCH_PLUGIN_IMPORT_TIMEOUT is one line and exit 2 (before: every plugin
"failed to load", exit 0), and `inf` means no limit. (Cross-run `--compare` pairing renamed cells:
tests/test_compare.py.)
"""

from __future__ import annotations

from kit import install_plugin, invoke, one_line_error, suite_dict, tiny_pair, write_suite

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)


def test_validate_warns_of_fewer_than_five_measured_prompts(tmp_path):
    target, draft = tiny_pair(tmp_path)
    suite = suite_dict(target, draft, [{"name": "ar"}])
    suite["datasets"] = [{"name": "wikitext-2", "prompts": 6, "warmup": 2, "L_max": 16}]
    result = invoke("validate", write_suite(tmp_path, suite))
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.stderr.splitlines() if "measured per cell" in line]
    assert line.startswith("warning: dataset wikitext-2: 6 prompts with 2 warmup leave 4 measured per cell")
    assert "raise prompts to 7" in line
    suite["datasets"][0]["prompts"] = 7
    assert "measured per cell" not in invoke("validate", write_suite(tmp_path, suite)).stderr


def test_decoders_shows_a_default_factorys_value():
    result = invoke("decoders")
    assert result.exit_code == 0, result.output
    assert "PydanticUndefined" not in result.output
    assert "extra_body={}" in result.output.replace("\n", "").replace("│", "").replace(" ", "")


PLUGIN = """
from dtbench.api import Decoder, DecoderParams, Step


class P(DecoderParams):
    pass


class Fine(Decoder[P]):
    def generate(self, input_ids, max_new_tokens):
        yield Step((1,))
"""


def test_a_bad_import_time_limit_is_one_line_and_inf_is_no_limit(tmp_path, monkeypatch):
    install_plugin(monkeypatch, tmp_path / "site", "dtbench-fine", {"fine": "dtbench_fine:Fine"}, PLUGIN)
    for bad in ("abc", "0", "-1", "nan"):
        monkeypatch.setenv("DTBENCH_PLUGIN_IMPORT_TIMEOUT", bad)
        one_line_error(invoke("plugins"), "DTBENCH_PLUGIN_IMPORT_TIMEOUT", "not a number of seconds")
    monkeypatch.setenv("DTBENCH_PLUGIN_IMPORT_TIMEOUT", "inf")
    result = invoke("plugins")
    assert result.exit_code == 0, result.output
    assert "fine" in result.output and "failed to load" not in result.output
