"""Every bad input is a one-line error at `dtbench validate` time, before any model loads (exit 2), and no suite
file can take the machine down (issue 8, items 7-10)."""

from __future__ import annotations

import resource
import time

import pytest
from kit import invoke, one_line_error, save_tiny_llama, suite_dict, write_suite
from sqlalchemy import func, select

from dtbench.harness.models import loading as models
from dtbench.harness.store import db
from dtbench.harness.suites.suitebase import MAX_GRID
from dtbench.harness.suites.suitefile import MAX_NODES

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

BASE = {
    "name": "v",
    "device": "cpu",
    "target": {"model": "smollm2-135m", "dtype": "float32"},
    "draft": {"model": "smollm2-135m", "dtype": "bfloat16"},
    "datasets": [{"name": "wikitext-2", "prompts": 2, "warmup": 1, "L_max": 16}],
    "generation_lengths": [4],
    "decoders": [{"name": "ar"}, {"name": "linear", "params": {"k": 2}}],
}


def validate(tmp_path, suite, name="suite.yaml"):
    return invoke("validate", write_suite(tmp_path, suite, name))


@pytest.mark.parametrize(
    "change, needles",
    [
        ({"generation_lengths": [8, 8]}, ["generation_lengths", "lists a value twice"]),
        ({"generation_lengths": [10**24]}, ["generation_lengths", "at most 1048576"]),
        (
            {"datasets": [{"name": "wikitext-2", "L_max": 16}, {"name": "wikitext-2", "L_max": [32, 16]}]},
            ["dataset 'wikitext-2' with L_max 16 is listed twice"],
        ),
        ({"datasets": [{"name": "wikitext-2", "L_max": [16, 16]}]}, ["L_max lists a value twice"]),
        ({"datasets": [{"name": "wikitext-2", "prompts": True}]}, ["datasets.0.prompts", "booleans are not numbers"]),
        ({"generation_lengths": [True]}, ["generation_lengths.0", "booleans are not numbers"]),
        ({"decoders": [{"name": "ar", "sweep": {"k": []}}]}, ["sweep over 'k' has no values"]),
        (
            {"decoders": [{"name": "linear", "sweep": {"k": list(range(1, 65)), "x": list(range(200))}}]},
            ["sweep expands to 12800 decoders", f"limit of {MAX_GRID}"],
        ),
        ({"timeout_s": 0}, ["timeout_s must be a positive number"]),
    ],
)
def test_bad_suite_values(tmp_path, change, needles):
    one_line_error(validate(tmp_path, {**BASE, **change}), *needles)


def test_bool_is_not_a_decoder_int_and_errors_name_file_and_line(tmp_path):
    suite = {**BASE, "decoders": [{"name": "ar"}, {"name": "linear", "params": {"k": True}}]}
    line = one_line_error(validate(tmp_path, suite), "decoder 'linear': params.k", "booleans are not numbers")
    path = tmp_path / "suite.yaml"
    text = path.read_text().splitlines()
    entry_line = next(i for i, t in enumerate(text, 1) if "name: linear" in t)
    assert line.startswith(f"error: {path}:{entry_line}: decoders.1: ")


def test_decoder_level_errors_carry_file_and_line(tmp_path):
    suite = {**BASE, "decoders": [{"name": "ar"}, {"name": "linear", "params": {"k": 0}}]}
    one_line_error(validate(tmp_path, suite), "suite.yaml:", "decoders.1: decoder 'linear': params.k")
    suite = {**BASE, "decoders": [{"name": "ar"}, {"name": "lineer"}]}
    one_line_error(validate(tmp_path, suite), "decoders.1: unknown decoder 'lineer'", "did you mean 'linear'")
    suite = {**BASE, "draft": None, "decoders": [{"name": "linear"}]}
    one_line_error(validate(tmp_path, suite), "decoders.0: decoder 'linear' needs a draft model")


def test_label_of_the_reference_is_not_a_cycle(tmp_path):
    suite = {**BASE, "decoders": [{"name": "linear", "label": "ar", "params": {"k": 2}}]}
    line = one_line_error(validate(tmp_path, suite), "label 'ar' of decoder 'linear' is the label of the reference")
    assert "cycle" not in line


def test_non_utf8_suite(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    one_line_error(invoke("validate", str(path)), "latin1.yaml:1: not UTF-8 text")


def alias_bomb(levels: int) -> str:
    lines = ["name: bomb", "l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    lines += [
        "datasets: [{name: wikitext-2}]",
        "generation_lengths: [4]",
        f"decoders: [{{name: ar, sweep: {{x: *l{levels}}}}}]",
    ]
    return "\n".join(lines) + "\n"


def test_yaml_alias_bombs_are_refused_quickly_and_briefly(tmp_path):
    start = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    line = one_line_error(validate(tmp_path, alias_bomb(7)), f"more than {MAX_NODES} values", "YAML aliases")
    assert time.monotonic() - start < 60  # was 442 s and 24 GB before the cap; generous for a loaded machine
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 500_000  # KiB: well under 0.5 GB more
    assert len(line) < 300


def test_long_values_are_clipped_in_errors(tmp_path):
    label = "x" * 300  # the longest label allowed (the column width); clipped to 80 in the error
    suite = {**BASE, "decoders": [{"name": "ar", "label": label}, {"name": "linear", "label": label}]}
    line = one_line_error(validate(tmp_path, suite), "is used twice")
    assert len(line) < 400


def test_text_files_that_are_not_text(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("Some ordinary text. " * 50)
    (corpus / "zeros.txt").write_bytes(b"\0" * 4096)
    suite = {**BASE, "datasets": [{"name": "text-files", "path": str(corpus), "prompts": 2, "warmup": 1, "L_max": 16}]}
    one_line_error(validate(tmp_path, suite), "zeros.txt is not a text document")
    (corpus / "zeros.txt").unlink()
    (corpus / "image.txt").write_bytes(bytes(range(128, 256)) * 8)
    one_line_error(validate(tmp_path, suite), "image.txt is not UTF-8 text")


@pytest.fixture(scope="module")
def tokenizer():
    from dtbench.harness.suites.suite import ModelSpec

    return models.load_tokenizer(ModelSpec())


def test_embedding_must_cover_the_tokenizer(tmp_path, tokenizer, data_dir):
    small = save_tiny_llama(tmp_path / "small", tokenizer, vocab=1000)
    padded = save_tiny_llama(tmp_path / "padded", tokenizer, vocab=len(tokenizer) + 64)
    result = invoke(
        "run",
        write_suite(tmp_path, suite_dict(small, small, [{"name": "ar"}])),
        "--db",
        str(tmp_path / "r.db"),
        "--data-dir",
        str(data_dir),
        "--no-progress",
    )
    one_line_error(result, "input embedding has 1000 rows, fewer than the tokenizer's 49152 tokens")
    with db.connect(str(tmp_path / "r.db"))() as s:  # the error came before any run was recorded
        assert s.scalar(select(func.count(db.Run.id))) == 0
    result = invoke(
        "run",
        write_suite(tmp_path, suite_dict(padded, padded, [{"name": "ar"}])),
        "--db",
        str(tmp_path / "p.db"),
        "--data-dir",
        str(data_dir),
        "--no-progress",
    )
    assert result.exit_code == 0, result.output


def test_context_limits(tmp_path, tokenizer):
    folder = save_tiny_llama(tmp_path / "m", tokenizer)  # 256 positions, rotary: a warning, not an error
    from dtbench.harness.suites.suite import ModelSpec

    assert "trained on 256 positions" in models.check_context(ModelSpec(model=str(folder)), 300)
    assert models.check_context(ModelSpec(model=str(folder)), 200) is None
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(
        GPT2Config(n_positions=64, n_embd=16, n_layer=1, n_head=2, vocab_size=len(tokenizer))
    ).save_pretrained(gpt2)
    tokenizer.save_pretrained(gpt2)
    suite = {
        **BASE,
        "target": {"model": str(gpt2), "dtype": "float32"},
        "draft": None,
        "decoders": [{"name": "ar"}],
        "generation_lengths": [64],
    }
    one_line_error(validate(tmp_path, suite), "has 64 learned positions", "80 tokens do not fit")


def test_network_hint_only_for_hub_ids():
    from dtbench.harness.models.loading import _short

    exc = ConnectionError("cannot connect to host")
    assert "no network?" in _short(exc, "EleutherAI/pythia-70m")
    assert "no network?" not in _short(exc, "./my-local-model")


def test_prompt_cap_is_the_deprecated_name_of_l_max(tmp_path):
    """Suites written before L_max (and the suite text stored with their runs) load the same, with one note;
    an entry that sets both names is a one-line error."""
    from dtbench.harness.suites.plan import plan_suite
    from dtbench.harness.suites.suitefile import load_suite

    def entries(key):
        return {
            "datasets": [{"name": "wikitext-2", "prompts": 2, "warmup": 1, key: [16, 32]}],
            "decoders": [{"name": "ar"}, {"name": "linear", "params": {"k": 2}, key: 16}],
        }

    result = validate(tmp_path, {**BASE, **entries("prompt_cap")}, "old.yaml")
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: ")]
    assert (
        len(notes) == 1
        and "old.yaml:" in notes[0]
        and "datasets.0: prompt_cap is the deprecated name of L_max (and 1 more entries); write L_max" in notes[0]
    ), result.stderr
    write_suite(tmp_path, {**BASE, **entries("L_max")}, "new.yaml")
    (old, _), (new, _) = load_suite(tmp_path / "old.yaml"), load_suite(tmp_path / "new.yaml")
    assert (
        old.model_dump() == new.model_dump() and old.datasets[0].l_maxes == [16, 32] and old.decoders[1].l_maxes == [16]
    )
    assert [(ds.name, l_max, T, B, c.label) for ds, l_max, T, B, c in plan_suite(old).cells()] == [
        (ds.name, l_max, T, B, c.label) for ds, l_max, T, B, c in plan_suite(new).cells()
    ]
    quiet = validate(tmp_path, {**BASE, **entries("L_max")}, "new.yaml")
    assert quiet.exit_code == 0 and "deprecated" not in quiet.output
    for i, key in ((0, "datasets"), (1, "decoders")):
        both = {**BASE, **entries("L_max")}
        both[key][i]["prompt_cap"] = 16
        one_line_error(
            validate(tmp_path, both), f"{key}.{i}.L_max: given twice, as L_max and as prompt_cap", "keep L_max only"
        )
