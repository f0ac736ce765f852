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
from models import examples, model_zoo, run_decoder

from dtbench.decoders.ar import ARParams, Autoregressive
from dtbench.testing.fixtures import VOCAB

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "examples" / "dtbench-prompt-lookup"


@pytest.fixture(scope="session")
def plugin():
    """Install the example plugin (non-editable, as a user would) into this environment; its module."""
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not available in this environment, so the example plugin cannot be installed")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--force-reinstall",
            "-q",
            str(PLUGIN_DIR),
        ],
        check=True,
    )
    importlib.invalidate_caches()
    sys.modules.pop("dtbench_prompt_lookup", None)  # a copy imported from the source tree by another test module
    from dtbench.harness import registry

    # and the registry's loaded classes: a module run before this one on the same xdist worker may have loaded the
    # copy installed before the reinstall (test_found_by_the_registry then saw two PromptLookup classes)
    registry.DECODERS._loaded.clear()
    return importlib.import_module("dtbench_prompt_lookup")


pytestmark = pytest.mark.usefixtures("one_thread")


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


@settings(max_examples=examples(40), deadline=None)
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
        assert 0 <= s.accepted <= s.drafted == s.depth <= 8
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


# --- through the CLI: listed, run by `dtbench run`, and a broken plugin named without stopping the others ---


def _invoke(*args):
    from click.testing import CliRunner

    from dtbench.cli.main import cli

    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture()
def broken_plugin(tmp_path, monkeypatch):
    """A distribution 'broken-plugin' whose decoder module fails to import."""
    (tmp_path / "broken_plugin_mod.py").write_text("import no_such_module_anywhere\n")
    info = tmp_path / "broken_plugin-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[dtbench.decoders]\nbroken = broken_plugin_mod:Broken\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()


def test_cli_lists_plugin_and_names_a_broken_one(plugin, broken_plugin):
    result = _invoke("decoders")
    assert result.exit_code == 0
    assert "prompt_lookup" in result.stdout and "dtbench-prompt-lookup" in result.stdout
    assert "linear" in result.stdout  # the others still load
    assert "broken-plugin 0.3" in result.stdout and "failed to load" in result.stdout
    assert "decoder 'broken' from distribution broken-plugin 0.3 failed to load: ModuleNotFoundError" in result.stderr


def test_suite_naming_a_broken_plugin_fails_in_one_line(tmp_path, broken_plugin):
    suite = tmp_path / "s.yaml"
    suite.write_text(
        "name: s\ndatasets: [{name: wikitext-2, prompts: 2, warmup: 1}]\ngeneration_lengths: [4]\n"
        "decoders: [{name: ar}, {name: broken}]\n"
    )
    result = _invoke("validate", str(suite))
    assert result.exit_code == 2
    assert result.stderr.strip() == (  # the suite's file, line and entry come first (issue 8 item 7)
        f"error: {suite}:4: decoders.1: decoder 'broken' from distribution broken-plugin 0.3 failed to load: "
        "ModuleNotFoundError: No module named 'no_such_module_anywhere'"
    )


@pytest.mark.slow
def test_dtbench_run_with_the_plugin(plugin, tmp_path, data_dir, broken_plugin):
    import yaml
    from sqlalchemy import select

    from dtbench.harness.store import db

    suite = {
        "name": "plugin",
        "device": "cpu",
        "target": {"model": "smollm2-135m"},
        "datasets": [{"name": "wikitext-2", "prompts": 2, "warmup": 1, "L_max": 48}],
        "generation_lengths": [12],
        "decoders": [{"name": "ar"}, {"name": "prompt_lookup", "params": {"ngram_size": 2, "num_draft_tokens": 4}}],
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(suite))
    dbfile = tmp_path / "r.db"
    result = _invoke("run", str(path), "--db", str(dbfile), "--data-dir", str(data_dir), "--no-progress")
    assert result.exit_code == 0, result.output
    with db.connect(str(dbfile))() as s:
        cell = s.scalars(select(db.Cell).where(db.Cell.decoder == "prompt_lookup")).one()
        assert cell.decoder_distribution == "dtbench-prompt-lookup" and cell.status == "done"
        assert [x.lossless for x in cell.samples] == [True, True]


def test_third_party_dataset_through_the_one_registry(plugin, tmp_path):
    """The example package's `jsonl-text` dataset is found in `dtbench.datasets` by the same Registry class as the
    decoders, with its distribution; built-in dataset names are reserved the same way."""
    import json

    from dtbench.harness.data import datasets as data
    from dtbench.harness.suites.suite import DatasetSpec

    found = data.REGISTRY.scan()
    assert found.entries["jsonl-text"].distribution == "dtbench-prompt-lookup"
    assert {n for n, e in found.entries.items() if e.distribution == "dtbench"} == {
        "wikitext-2",
        "pg19",
        "text-files",
        "spec-bench",
        "humaneval",
        "random-tokens",
    }
    corpus = tmp_path / "answers.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"answer {i} " * 40}) for i in range(3)) + "\n")
    docs = data.load_documents(DatasetSpec(name="jsonl-text", path=str(corpus)))
    assert [t for t, _ in docs] == ["answers.jsonl:1", "answers.jsonl:2", "answers.jsonl:3"]
    assert docs[2][1].startswith("answer 2 ")
    corpus.write_text('{"txt": 1}\n')
    suite = tmp_path / "s.yaml"
    suite.write_text(
        f"name: s\ndatasets: [{{name: jsonl-text, path: {corpus}, prompts: 2, warmup: 1}}]\n"
        "generation_lengths: [4]\ndecoders: [{name: ar}]\n"
    )
    result = _invoke("validate", str(suite))
    assert result.exit_code == 2
    assert result.stderr.strip().endswith('answers.jsonl:1: not a JSON object with a "text" field')


def test_plugin_dataset_declares_its_own_params(plugin, tmp_path):
    """A plugin dataset's own keys (jsonl-text's ``text_field``) live under the entry's ``params:`` and are
    validated by its Params model through the same code path as decoder params: an unknown key or a bad value is a
    one-line error at `dtbench validate`, before any model loads."""
    import json

    from dtbench.harness.data import datasets as data
    from dtbench.harness.errors import DtbenchError
    from dtbench.harness.suites.suite import DatasetSpec

    corpus = tmp_path / "answers.jsonl"
    corpus.write_text("\n".join(json.dumps({"body": f"answer {i} " * 40, "text": "x"}) for i in range(2)) + "\n")
    docs = data.load_documents(DatasetSpec(name="jsonl-text", path=str(corpus), params={"text_field": "body"}))
    assert [x for _, x in docs] == [f"answer {i} " * 40 for i in range(2)]
    assert data.dataset(DatasetSpec(name="jsonl-text", path=str(corpus))).params.text_field == "text"
    with pytest.raises(
        DtbenchError,
        match=r"^dataset 'jsonl-text': params.text_fild: unknown parameter "
        r"\(parameters: text_field\)$",
    ):
        data.load_documents(DatasetSpec(name="jsonl-text", path=str(corpus), params={"text_fild": "body"}))
    with pytest.raises(
        DtbenchError,
        match=r"^dataset 'wikitext-2': params.text_field: unknown parameter "
        r"\(parameters: none\)$",
    ):
        data.check_dataset(DatasetSpec(name="wikitext-2", params={"text_field": "body"}))
    with pytest.raises(DtbenchError, match=r'answers.jsonl:1: not a JSON object with a "missing" field'):
        data.load_documents(DatasetSpec(name="jsonl-text", path=str(corpus), params={"text_field": "missing"}))
    suite = tmp_path / "s.yaml"
    for params, message in (
        ("{text_field: ''}", "params.text_field: String should have at least 1 character"),
        ("{text_field: body, n: 1}", "params.n: unknown parameter"),
    ):
        suite.write_text(
            f"name: s\ndatasets: [{{name: jsonl-text, path: {corpus}, prompts: 2, warmup: 1, "
            f"params: {params}}}]\ngeneration_lengths: [4]\ndecoders: [{{name: ar}}]\n"
        )
        result = _invoke("validate", str(suite))
        assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.stderr
    suite.write_text(
        f"name: s\ndatasets: [{{name: jsonl-text, path: {corpus}, prompts: 2, warmup: 1, "
        "params: {text_field: body}}]\ngeneration_lengths: [4]\ndecoders: [{name: ar}]\n"
    )
    assert _invoke("validate", str(suite)).exit_code == 0


def test_a_plugin_report_format_reaches_report_format(plugin, tmp_path):
    """Issue 40 item 4: the example plugin's `dtbench.formats` entry point (tsv) is a --format choice after
    `pip install`, rendering the same Document the built-ins do; the built-ins are declared in the same group."""
    import shutil

    from kit import invoke

    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="dtbench.formats")}
    assert {"table", "markdown", "csv", "json", "html", "tsv"} <= set(eps)
    assert eps["tsv"].dist is not None and eps["tsv"].dist.name == "dtbench-prompt-lookup"
    old = Path(shutil.copy(Path(__file__).parent / "fixtures" / "results-0001.db", tmp_path / "r.db"))
    assert invoke("db", "upgrade", "--db", str(old)).exit_code == 0
    tsv = invoke("report", "--db", str(old), "--run", "1", "--format", "tsv")
    csv = invoke("report", "--db", str(old), "--run", "1", "--format", "csv")
    assert tsv.exit_code == 0, tsv.output
    header = tsv.stdout.splitlines()[0].split("\t")
    assert {"label", "throughput_mean", "speedup"} <= set(header)  # the same Document's rows, tab-separated
    assert len(tsv.stdout.splitlines()) == len(csv.stdout.splitlines())
    assert "tsv" in invoke("report", "--help").stdout
