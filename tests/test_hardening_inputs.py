"""Files a suite names whose content is untrusted (issues 19 and 33): a model folder's own Python code never
runs unless the suite opts in (`trust_remote_code`), question files (escaped categories, duplicate ids, repeated
categories, bad lines, a download cache that is a file) and chat templates (sandboxed, bounded, rendered at
validate): each failure is one error line before any model loads.

Split out of tests/test_hardening.py by subject (issue 57 item 3); each section names the issue item it tests.
Shared helpers: tests/hardening_kit.py.
"""

from __future__ import annotations

import json

import pytest
from hardening_kit import HOSTILE_CATEGORY, tiny_suite
from kit import invoke, one_line_error, write_suite

TIER = "full"  # tests/conftest.py: the tier this module runs in (issue 57)


# --- issue 19 item 1: a model folder's own code never runs unless the suite opts in --------------------------------


def _evil_folder(root, marker):
    """A local model folder whose config maps AutoConfig/AutoModelForCausalLM/AutoTokenizer to code in the folder;
    importing that code creates ``marker``."""
    from dtbench.harness.models import loading as models
    from dtbench.harness.suites.suite import ModelSpec

    folder = root / "evil-model"
    folder.mkdir()
    models.load_tokenizer(ModelSpec()).save_pretrained(folder)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evil19",
                "max_position_embeddings": 128,
                "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
            }
        )
    )
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil19'\n"
        "class EvilModel(PreTrainedModel):\n    config_class = EvilConfig\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    return folder


@pytest.mark.parametrize("command", ["validate", "run"])
def test_remote_code_in_a_model_folder_never_runs(tmp_path, data_dir, command):
    from click.testing import CliRunner

    from dtbench.cli.main import cli

    marker = tmp_path / "marker"
    folder = _evil_folder(tmp_path, marker)
    suite = write_suite(tmp_path, tiny_suite(target={"model": str(folder), "dtype": "float32"}))
    args = [command, suite] + (
        ["--db", str(tmp_path / "r.db"), "--data-dir", str(data_dir), "--no-progress"] if command == "run" else []
    )
    result = CliRunner().invoke(cli, args, input="y\ny\ny\ny\n", catch_exceptions=False)
    assert not marker.exists(), "the model folder's code ran"
    line = one_line_error(result, "trust_remote_code", "evil.py")
    assert str(folder) in line


def test_remote_code_opt_in_is_warned_and_recorded(tmp_path):
    marker = tmp_path / "marker"
    folder = _evil_folder(tmp_path, marker)
    suite = write_suite(
        tmp_path, tiny_suite(target={"model": str(folder), "dtype": "float32", "trust_remote_code": True})
    )
    result = invoke("validate", suite)
    assert result.exit_code == 0, result.output
    assert "trust_remote_code" in result.stderr and "evil.py" in result.stderr
    assert not marker.exists()  # validate reads configs, never imports


@pytest.mark.fast  # keeps the module's subject in the fast tier (issue 57)
def test_every_load_passes_trust_remote_code_false(monkeypatch):
    """models.py's loaders hand transformers an explicit trust_remote_code (False unless the spec opts in)."""
    import transformers

    from dtbench.harness.models import loading as models
    from dtbench.harness.suites.suite import ModelSpec

    seen = []

    def spy(name):
        def fake(*args, **kwargs):
            seen.append((name, kwargs.get("trust_remote_code", "absent")))
            raise OSError("stop here")

        return fake

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy("tokenizer"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy("model"))
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy("config"))
    spec = ModelSpec(model="some-org/some-model")
    import torch

    for call in (
        lambda: models.load_tokenizer(spec),
        lambda: models.load_model(spec, torch.device("cpu")),
        lambda: models.check_context(spec, 10),
    ):
        try:
            call()
        except Exception:
            pass
    assert [k for _, k in seen] == [False, False, False], seen


# === issue 33: question files and chat templates ===================================================================

QUESTIONS = [
    {"question_id": "a1", "category": "poetry", "turns": ["Write a haiku about rain.", "Now make it rhyme."]},
    {"question_id": "a2", "category": "poetry", "turns": ["Write a couplet about the sea."]},
    {"question_id": "b1", "category": "code-review", "turns": ["Is x = x + 1 idempotent?"]},
    {"question_id": "b2", "category": "code-review", "turns": ["What does git rebase do?"]},
]


def _qfile(tmp_path, rows, name="q.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _question_suite(tmp_path, rows=None, **entry) -> str:
    """A question suite on the embedded model over a jsonl of ``rows`` (chat_template none unless given)."""
    template = entry.pop("chat_template", "none")
    ds = {
        "name": "spec-bench",
        "path": _qfile(tmp_path, rows or QUESTIONS),
        "prompts": 1,
        "warmup": 0,
        "L_max": 64,
        **entry,
    }
    return write_suite(tmp_path, tiny_suite(datasets=[ds], chat_template=template))


# --- issue 33 item 1: terminal escapes in error lines --------------------------------------------------------------


def test_escape_codes_in_a_question_category_are_shown_escaped(tmp_path):
    rows = [*QUESTIONS, {"question_id": "c1", "category": HOSTILE_CATEGORY, "turns": ["hi there"]}]
    line = one_line_error(
        invoke("validate", _question_suite(tmp_path, rows, categories=["nosuch"])),
        "unknown category 'nosuch'",
        "\\x1b[31mRED\\x1b]0;pwn\\x07",
    )
    assert "\x1b" not in line and "\x07" not in line


def test_escape_codes_in_a_suite_category_are_refused(tmp_path):
    line = one_line_error(
        invoke("validate", _question_suite(tmp_path, categories=["nosuch\x1b[31m"])),
        "categories.0",
        "control character (\\x1b)",
    )
    assert "\x1b" not in line


# --- issue 33 item 3: distinct questions merged --------------------------------------------------------------------


def test_duplicate_question_ids_are_refused(tmp_path):
    rows = [{"question_id": 7, "category": "qa", "turns": [f"Question {i}?"]} for i in range(4)]
    one_line_error(
        invoke("validate", _question_suite(tmp_path, rows, prompts=3)),
        "q.jsonl:2: question_id 7 is also the question_id of line 1",
    )


@pytest.mark.parametrize(
    "categories, needle",
    [
        (["qa", "qa"], "categories lists qa twice"),
        (["mt_bench", "writing"], "categories name 'mt_bench' and 'writing', which share questions"),
    ],
)
def test_repeated_categories_are_refused(tmp_path, data_dir, categories, needle):
    ds = {
        "name": "spec-bench",
        "data_dir": str(data_dir),
        "prompts": 2,
        "warmup": 0,
        "L_max": 64,
        "categories": categories,
    }
    one_line_error(invoke("validate", write_suite(tmp_path, tiny_suite(datasets=[ds], chat_template="none"))), needle)


# --- issue 33 item 8: question-file content ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, needle",
    [
        ("[" * 100_000, "q.jsonl:5: nests too deeply"),
        ('{"question_id": "s", "category": "qa", "turns": ["x \\ud800 y"]}', "q.jsonl:5: turn 1 holds \\ud800"),
        ('{"question_id": "s", "category": "qa", "turns": [""]}', "q.jsonl:5: turn 1 is empty"),
        ('{"question_id": "s", "category": "qa", "turns": ["fine", "  "]}', "q.jsonl:5: turn 2 is empty"),
        ('{"question_id": ["x"], "category": "qa", "turns": ["fine"]}', "q.jsonl:5: `question_id` must be"),
    ],
)
def test_bad_question_lines_are_one_line_at_validate(tmp_path, line, needle):
    one_line_error(invoke("validate", _question_suite(tmp_path, [*QUESTIONS, line])), needle)


# --- issue 33 item 9: the download cache is a file -----------------------------------------------------------------


@pytest.mark.parametrize("where", ["root", "entry"])
def test_download_cache_that_is_a_file(tmp_path, monkeypatch, where):
    blocker = tmp_path / "cache"
    blocker.write_text("a file")
    if where == "entry":
        blocker.unlink()
        (blocker / "spec-bench").parent.mkdir()
        (blocker / "spec-bench").write_text("a file")
    monkeypatch.setenv("DTBENCH_CACHE", str(blocker))
    monkeypatch.delenv("DTBENCH_DATA_DIR", raising=False)
    monkeypatch.setenv("DTBENCH_SPEC_BENCH_URL", "http://127.0.0.1:9/never-fetched")
    ds = {"name": "spec-bench", "prompts": 1, "warmup": 0, "L_max": 64}
    suite = write_suite(tmp_path, tiny_suite(datasets=[ds], chat_template="none"))
    for command in (["validate", suite], ["run", suite, "--db", str(tmp_path / "r.db"), "--no-progress"]):
        one_line_error(invoke(*command), "spec-bench: cannot use the download cache", "set DTBENCH_CACHE")


# --- issue 33 item 7: chat templates: rendered at validate, bounded, one line --------------------------------------

TEMPLATES = {
    "raise": ("{{ raise_exception('no') }}", "TemplateError: no"),
    "escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    "undefined": ("{{ messages[5].content.upper() }}", "UndefinedError"),
    "loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "rendering one prompt took longer than",
    ),
    "repeat": ("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", "renders more than"),
    "empty": ("  \n", "is empty (it would render empty prompts)"),
    "nothing": ("{% if false %}x{% endif %}", "the prompt is empty (0 tokens)"),
}


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
@pytest.mark.parametrize("command", ["validate", "run"])
def test_chat_template_failures_are_one_line_before_models_load(tmp_path, monkeypatch, kind, command):
    from dtbench.harness.data import chat
    from dtbench.harness.models import loading as models

    monkeypatch.setattr(chat, "RENDER_SECONDS", 1.0, raising=False)  # raising: the test fails on old code too
    text, needle = TEMPLATES[kind]
    template = tmp_path / "t.jinja"
    template.write_text(text)

    def no_loading(*a, **kw):
        raise AssertionError("a model loaded before the chat template was checked")

    monkeypatch.setattr(models, "load_model", no_loading)
    suite = _question_suite(tmp_path, chat_template=str(template))
    args = [command, suite] + (["--db", str(tmp_path / "r.db"), "--no-progress"] if command == "run" else [])
    line = one_line_error(invoke(*args), needle)
    assert str(template) in line or kind == "empty" and "t.jinja" in line


def test_a_later_turn_the_template_fails_on_fails_its_cells(tmp_path):
    """Rendered with the reference's real answer (after validate rendered a placeholder), turn 2 fails its cells."""
    from dtbench.harness.data import chat

    class Tok:
        special_tokens_map: dict = {}

        def apply_chat_template(self, chat_, **kw):
            return {"input_ids": [1, 2, 3]}

        def decode(self, tokens, skip_special_tokens=True):
            return "BOOM"

    template = (
        "{% for m in messages %}{% if m.content == 'BOOM' %}{{ raise_exception('bad answer') }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    from dtbench.harness.data.prompt import Prompt

    renderer = chat.Renderer(Tok(), template, None, 64, "t.jinja")
    prompts = chat.ChatPrompts(
        [Prompt(0, "q", (1,), turn=1, question_id="1"), Prompt(1, "q2", (), turn=2, question_id="1")],
        renderer,
        {0: ("a", "b"), 1: ("a", "b")},
    )
    with pytest.raises(chat.PromptFailed, match="chat_template t.jinja: TemplateError: bad answer"):
        chat.resolve(prompts, 1, lambda index: [5])
