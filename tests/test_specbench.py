"""Question datasets (issue 21): the spec-bench loader (shipped file, a user's jsonl, the pinned download against a
server on 127.0.0.1), chat templates, two-turn questions prompted with the reference's turn-1 answer, bad input at
validate time, and the --by / --spec-bench reports on a database the runner wrote."""

from __future__ import annotations

import csv
import hashlib
import http.server
import io
import json
import threading
from collections import Counter
from pathlib import Path

import pytest
from kit import invoke, one_line_error, save_tiny_llama, tiny_pair, write_suite

from dtbench.harness.data import chat, questions
from dtbench.harness.errors import DtbenchError
from dtbench.harness.suites.suite import DatasetSpec

TIER = "fast"  # tests/conftest.py: the tier this module runs in (issue 57)

pytestmark = pytest.mark.usefixtures("one_thread")

USER_QUESTIONS = [
    {"question_id": "a1", "category": "poetry", "turns": ["Write a haiku about rain.", "Now make it rhyme."]},
    {"question_id": "a2", "category": "poetry", "turns": ["Write a couplet about the sea.", "Translate it to French."]},
    {"question_id": "b1", "category": "code-review", "turns": ["Is x = x + 1 idempotent?"]},
    {"question_id": "b2", "category": "code-review", "turns": ["What does git rebase do?"]},
]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_shipped_file_counts(data_dir):
    spec = DatasetSpec(name="spec-bench", data_dir=str(data_dir))
    found, source = questions.load_questions(spec)
    assert len(found) == 480 and source["sha256"] == questions.SPEC_BENCH_SHA256
    counts = Counter(q.category for q in found)
    assert {c: counts[c] for c in questions.MT_BENCH} == {c: 10 for c in questions.MT_BENCH}
    assert {c: counts[c] for c in ("translation", "summarization", "qa", "math_reasoning", "rag")} == {
        c: 80 for c in ("translation", "summarization", "qa", "math_reasoning", "rag")
    }
    assert all(len(q.turns) == 2 for q in found if q.category in questions.MT_BENCH)
    assert all(len(q.turns) == 1 for q in found if q.category not in questions.MT_BENCH)
    # the six groups by default, N questions and W warmup per group, MT-bench's two turns consecutive
    slots = questions.layout(DatasetSpec(name="spec-bench", data_dir=str(data_dir), prompts=3, warmup=1), seed=0)
    assert [s.group for s in slots if s.turn == 1] == [g for g in questions.GROUPS for _ in range(3)]
    assert len(slots) == 3 * 2 + 5 * 3
    assert sum(s.warmup for s in slots) == 2 + 5  # the first question of each group, both turns for MT-bench
    mt = [s for s in slots if s.group == "mt_bench"]
    assert [(s.question.question_id, s.turn) for s in mt[:2]] == [
        (mt[0].question.question_id, 1),
        (mt[0].question.question_id, 2),
    ]
    other = questions.layout(DatasetSpec(name="spec-bench", data_dir=str(data_dir), prompts=3, warmup=1), seed=1)
    assert [s.question.question_id for s in other] != [s.question.question_id for s in slots]  # the seed chooses


def test_user_jsonl_with_other_categories(tmp_path):
    path = _jsonl(tmp_path / "q.jsonl", USER_QUESTIONS)
    slots = questions.layout(DatasetSpec(name="spec-bench", path=str(path), prompts=2, warmup=1), seed=0)
    assert [(s.group, s.turn) for s in slots] == [("poetry", 1), ("poetry", 2)] * 2 + [("code-review", 1)] * 2
    picked = questions.layout(
        DatasetSpec(name="spec-bench", path=str(path), prompts=1, warmup=0, categories=["code-review"]), seed=0
    )
    assert [s.question.category for s in picked] == ["code-review"]
    with pytest.raises(DtbenchError, match="unknown category 'mt_bench'.*code-review, poetry"):
        questions.layout(
            DatasetSpec(name="spec-bench", path=str(path), prompts=1, warmup=0, categories=["mt_bench"]), seed=0
        )
    with pytest.raises(DtbenchError, match="'poetry' has 2 questions, 3 asked for"):
        questions.layout(DatasetSpec(name="spec-bench", path=str(path), prompts=3, warmup=0), seed=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(USER_QUESTIONS[0]) + "\n" + json.dumps({"question_id": 9, "category": "x"}) + "\n")
    with pytest.raises(DtbenchError, match=r"bad.jsonl:2: `turns` must be a non-empty list"):
        questions.load_questions(DatasetSpec(name="spec-bench", path=str(bad)))


class _Files(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass


def _serve(folder: Path):
    handler = lambda *a, **kw: _Files(*a, directory=str(folder), **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_download_pinned_sha256_and_cache(tmp_path, data_dir, monkeypatch):
    """Offline: the download path against a server on 127.0.0.1; a wrong file is refused and nothing is cached; a
    good one is cached and read from the cache afterwards (the server gone)."""
    served = tmp_path / "srv"
    served.mkdir()
    good = (data_dir / "spec-bench" / "question.jsonl").read_bytes()
    (served / "question.jsonl").write_bytes(good)
    (served / "tampered.jsonl").write_bytes(good.replace(b"Compose", b"Compile", 1))
    cache = tmp_path / "cache"
    monkeypatch.setenv("DTBENCH_CACHE", str(cache))
    monkeypatch.delenv("DTBENCH_DATA_DIR", raising=False)
    server = _serve(served)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        monkeypatch.setenv(questions.URL_ENV, f"{base}/tampered.jsonl")
        with pytest.raises(DtbenchError, match="not the pinned file's"):
            questions.load_questions(DatasetSpec(name="spec-bench"))
        assert not any(cache.rglob("*.jsonl"))
        monkeypatch.setenv(questions.URL_ENV, f"{base}/question.jsonl")
        found, source = questions.load_questions(DatasetSpec(name="spec-bench"))
    finally:
        server.shutdown()
    assert len(found) == 480 and source["source"] == "download" and source["sha256"] == questions.SPEC_BENCH_SHA256
    cached = list((cache / "spec-bench").glob("*.jsonl"))
    assert len(cached) == 1 and hashlib.sha256(cached[0].read_bytes()).hexdigest() == questions.SPEC_BENCH_SHA256
    monkeypatch.setenv(questions.URL_ENV, f"{base}/gone.jsonl")  # the server is down: the cache answers
    assert len(questions.load_questions(DatasetSpec(name="spec-bench"))[0]) == 480


@pytest.fixture(scope="module")
def tokenizer():
    from dtbench.harness.models import loading as models
    from dtbench.harness.suites.suite import ModelSpec

    return models.load_tokenizer(ModelSpec())


def test_template_rendering_equals_apply_chat_template(tokenizer, tmp_path):
    turns, answers = ["What is 2 + 2?", "And times 3?"], ["It is 4."]
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": turns[0]},
        {"role": "assistant", "content": answers[0]},
        {"role": "user", "content": turns[1]},
    ]
    template = chat.template_text("auto", tokenizer, "smollm2-135m")
    expected = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert chat.render(tokenizer, template, turns, answers, "Be brief.") == list(expected["input_ids"])
    assert tokenizer.decode(chat.render(tokenizer, template, turns[:1], [], None)).endswith(
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.render(tokenizer, None, turns, answers, None) == tokenizer.encode(
        "What is 2 + 2?\n\nIt is 4.\n\nAnd times 3?"
    )
    vicuna = chat.template_text(
        str(Path(__file__).parents[1] / "suites" / "templates" / "vicuna.jinja"), tokenizer, "x"
    )
    text = tokenizer.decode(chat.render(tokenizer, vicuna, turns, answers, None))
    assert text == (
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
        "helpful, detailed, and polite answers to the user's questions. USER: What is 2 + 2? ASSISTANT: "
        "It is 4.</s> USER: And times 3? ASSISTANT:"
    )  # FastChat's vicuna_v1.1
    bare = type(tokenizer).from_pretrained(save_tiny_llama(tmp_path / "m", tokenizer))
    bare.chat_template = None
    with pytest.raises(DtbenchError, match="model 'tiny' has no chat template"):
        chat.template_text("auto", bare, "tiny")


@pytest.fixture(scope="module")
def specbench_run(tmp_path_factory):
    """A run of a two-turn question suite on the tiny pair, with every prompt each decoder was given recorded."""
    import dtbench.harness.measurement.local_measurer as cells

    root = tmp_path_factory.mktemp("sb")
    target, draft = tiny_pair(root)
    qfile = _jsonl(root / "q.jsonl", USER_QUESTIONS)
    suite = {
        "name": "sb",
        "seed": 0,
        "device": "cpu",
        "target": {"model": str(target), "dtype": "float64"},
        "draft": {"model": str(draft), "dtype": "float64"},
        "datasets": [{"name": "spec-bench", "path": str(qfile), "prompts": 2, "warmup": 1, "L_max": 120}],
        "generation_lengths": [8],
        "system_prompt": "Be brief.",
        "isolation": "none",  # the spy below patches this process: measure here, not in a child
        "decoders": [
            {"name": "ar"},
            {"name": "linear", "params": {"k": 3}},
            {"name": "fixed_tree", "params": {"depth": 3, "branching": 2}},
        ],
    }
    path = write_suite(root, suite)
    seen: list[tuple[str, int, tuple[int, ...]]] = []
    real = cells.measure_rows

    def spy(decoder, prompts, *a, **kw):  # B = 1: one prompt per call
        seen.append((type(decoder).__name__, len(seen), tuple(prompts[0])))
        return real(decoder, prompts, *a, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(cells, "measure_rows", spy)
    db = f"sqlite:///{root / 'r.db'}"
    try:
        result = invoke("run", path, "--db", db, "--no-progress", "--no-report")
    finally:
        mp.undo()
    assert result.exit_code == 0, result.output
    return db, seen, target


def test_turn_two_prompt_holds_the_references_answer(specbench_run):
    from sqlalchemy import create_engine, text

    from dtbench.harness.models import loading as models
    from dtbench.harness.suites.suite import ModelSpec

    db, seen, target = specbench_run
    engine = create_engine(db)
    with engine.connect() as c:
        rows = c.execute(
            text(
                "select c.label, s.prompt_index, s.turn, s.task_group, s.category, s.question_id, "
                "s.output_tokens, s.prompt_tokens, s.warmup, s.new_tokens from samples s join cells c "
                "on c.id = s.cell_id order by s.prompt_index, c.id"
            )
        ).all()
        env = json.loads(c.execute(text("select environment from runs")).scalar())
    assert env["chat"]["chat_template"] == "auto" and env["chat"]["system_prompt"] == "Be brief."
    assert len(env["chat"]["template_sha256"]) == 64
    by_index: dict[int, list] = {}
    for r in rows:
        by_index.setdefault(r.prompt_index, []).append(r)
    assert [(rs[0].task_group, rs[0].turn, rs[0].warmup) for _, rs in sorted(by_index.items())] == [
        ("poetry", 1, True),
        ("poetry", 2, True),
        ("poetry", 1, False),
        ("poetry", 2, False),
        ("code-review", 1, True),
        ("code-review", 1, False),
    ]
    tok = models.load_tokenizer(ModelSpec(model=str(target)))
    prompts_by_order = [ids for _, _, ids in seen]  # measure calls in order: per prompt index, ar, linear, fixed_tree
    assert len(prompts_by_order) == 3 * len(by_index)
    for index, rs in sorted(by_index.items()):
        given = prompts_by_order[3 * index : 3 * index + 3]
        assert given[0] == given[1] == given[2]  # every decoder timed on the identical prompt
        assert all(r.prompt_tokens == len(given[0]) for r in rs)
        if rs[0].turn == 2:
            answer = tok.decode(json.loads(by_index[index - 1][0].output_tokens), skip_special_tokens=True).strip()
            prompt = tok.decode(list(given[0]))
            q = next(q for q in USER_QUESTIONS if q["question_id"] == rs[0].question_id)
            assert answer and f"{q['turns'][0]}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>" in prompt
            assert prompt.endswith(f"{q['turns'][1]}<|im_end|>\n<|im_start|>assistant\n")
    assert all(r.new_tokens <= 8 for r in rows)


def test_reports_by_task_and_spec_bench(specbench_run):
    db, _, _ = specbench_run
    result = invoke("report", "--db", db, "--by", "group", "--format", "markdown")
    assert result.exit_code == 0, result.output
    assert "### sb · poetry" not in result.output  # the dataset column reads "<dataset> · <task>"
    assert "spec-bench · poetry · L_max=120 · T=8" in result.output
    assert "spec-bench · code-review · L_max=120 · T=8" in result.output
    result = invoke("report", "--db", db, "--by", "category", "--format", "csv")
    assert result.exit_code == 0 and "spec-bench · code-review" in result.output
    result = invoke("report", "--db", db, "--spec-bench", "--format", "json")
    assert result.exit_code == 0, result.output
    rows = {r["label"]: r for r in json.loads(result.output)["rows"]}
    assert set(rows) == {"ar", "linear", "fixed_tree"}
    assert rows["ar"]["poetry"] == rows["ar"]["overall"] == rows["ar"]["mat"] == 1.0
    assert rows["ar"]["acceptance_rate"] is None and rows["ar"]["per_position"] == []
    for label in ("linear", "fixed_tree"):
        r = rows[label]
        assert r["questions"] == 2 and r["poetry"] > 0 and r["code-review"] > 0 and r["overall"] > 0
        assert 1.0 <= r["mat"] and 0.0 <= r["acceptance_rate"] <= 1.0
        assert r["mean_acceptance_length"] >= 1.0 and all(0 <= p <= 1 for p in r["per_position"])
    assert rows["linear"]["per_position"] == sorted(rows["linear"]["per_position"], reverse=True)
    table = invoke("report", "--db", db, "--spec-bench")
    assert table.exit_code == 0 and "#MAT" in table.output and "Mean acc. len (vLLM)" in table.output
    md = invoke("report", "--db", db, "--spec-bench", "--format", "markdown")
    assert md.exit_code == 0 and md.output.startswith("### Spec-Bench · run "), md.output
    assert "#MAT" in md.output and "\n|---" in md.output
    page = invoke("report", "--db", db, "--spec-bench", "--format", "html")
    assert page.exit_code == 0 and page.output.startswith("<!DOCTYPE html>") and "<th>#MAT</th>" in page.output
    flat = list(csv.DictReader(io.StringIO(invoke("report", "--db", db, "--spec-bench", "--format", "csv").output)))
    assert {r["label"] for r in flat} == set(rows) and flat[0]["prompt_cap"] == "120"
    for r in flat:  # the per-position curve as ;-joined shares, JSON's list (empty where nothing was accepted)
        assert [float(p) for p in r["per_position"].split(";") if p] == pytest.approx(
            rows[r["label"]]["per_position"], rel=1e-5
        )
    one_line_error(invoke("report", "--db", db, "--spec-bench", "--compare"), "--spec-bench")


def test_leaderboard_arithmetic():
    """speed.py's arithmetic on hand-made samples: per question, tokens and times summed over turns; mean over
    questions; divided by ar's; #MAT over steps after the prefill; vLLM's rates over drafting steps."""
    import pandas as pd

    from dtbench.reports.views.specbench import leaderboard

    def s(label, decoder, q, turn, tokens, secs, steps, drafted, accepted, group="mt_bench"):
        return dict(
            dataset="spec-bench",
            l_max=64,
            gen_length=8,
            label=label,
            decoder=decoder,
            status="completed",
            prompt_index=0,
            warmup=False,
            new_tokens=tokens,
            total_s=secs,
            task_group=group,
            category="x",
            turn=turn,
            question_id=q,
            step_tokens=steps,
            drafted=drafted,
            accepted=accepted,
        )

    frame = pd.DataFrame(
        [
            s("ar", "ar", "1", 1, 4, 4.0, [1, 1, 1, 1], [0] * 4, [0] * 4),
            s("ar", "ar", "1", 2, 4, 4.0, [1] * 4, [0] * 4, [0] * 4),
            s("ar", "ar", "2", 1, 6, 2.0, [1] * 6, [0] * 6, [0] * 6, group="qa"),
            s("lin", "linear", "1", 1, 4, 1.0, [1, 3], [0, 3], [0, 2]),
            s("lin", "linear", "1", 2, 4, 3.0, [1, 2, 1], [0, 3, 3], [0, 1, 0]),
            s("lin", "linear", "2", 1, 6, 1.0, [1, 4, 1], [0, 3, 3], [0, 3, 0], group="qa"),
        ]
    )
    board = leaderboard(frame).set_index("label")
    assert board.loc["lin", "mt_bench"] == pytest.approx((8 / 4.0) / (8 / 8.0))
    assert board.loc["lin", "qa"] == pytest.approx(6.0 / 3.0)
    assert board.loc["lin", "overall"] == pytest.approx(((8 / 4.0) + 6.0) / 2 / (((8 / 8.0) + 3.0) / 2))
    assert board.loc["lin", "mat"] == pytest.approx((3 + 2 + 1 + 4 + 1) / 5)
    assert board.loc["lin", "acceptance_rate"] == pytest.approx(6 / 15)
    assert board.loc["lin", "mean_acceptance_length"] == pytest.approx(1 + 6 / 5)
    assert board.loc["lin", "per_position"] == pytest.approx([3 / 5, 2 / 5, 1 / 5])
    assert board.loc["ar", "mat"] == 1.0


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"categories": ["nope"]}, "unknown category 'nope'"),
        ({"bad_line": True}, "q.jsonl:2: `turns` must be a non-empty list"),
        ({"no_template": True}, "has no chat template"),
    ],
)
def test_bad_input_is_one_line_at_validate(tmp_path, change, needle, tokenizer):
    target = save_tiny_llama(tmp_path / "m", tokenizer)
    if change.get("no_template"):
        cfg = json.loads((target / "tokenizer_config.json").read_text())
        cfg.pop("chat_template", None)
        (target / "tokenizer_config.json").write_text(json.dumps(cfg))
        for extra in ("chat_template.jinja", "chat_template.json"):
            (target / extra).unlink(missing_ok=True)
    rows = USER_QUESTIONS if not change.get("bad_line") else [USER_QUESTIONS[0], {"category": "poetry"}]
    qfile = _jsonl(tmp_path / "q.jsonl", rows)
    entry = {"name": "spec-bench", "path": str(qfile), "prompts": 1, "warmup": 0, "L_max": 64}
    if "categories" in change:
        entry["categories"] = change["categories"]
    suite = {
        "name": "bad",
        "device": "cpu",
        "target": {"model": str(target), "dtype": "float64"},
        "datasets": [entry],
        "generation_lengths": [4],
        "decoders": [{"name": "ar"}],
    }
    one_line_error(invoke("validate", write_suite(tmp_path, suite)), needle)


def test_turn_two_without_the_reference_answer_fails_its_cells(tmp_path, tokenizer):
    """When the reference's turn-1 sample is missing (its cell failed), the turn-2 group's cells fail with a one-line
    reason and the run goes on; chat.resolve itself says which answer is missing."""
    from dtbench.harness.data.chat import ChatPrompts, Renderer, TurnNotReady, resolve
    from dtbench.harness.data.prompt import Prompt

    prompts = ChatPrompts(
        [Prompt(0, "q", (5, 6), "g", "c", 1, "7"), Prompt(1, "q2", (), "g", "c", 2, "7")],
        Renderer(tokenizer, None, None, 64),
        {0: ("a", "b"), 1: ("a", "b")},
    )
    with pytest.raises(TurnNotReady, match="question 7 turn 2: the reference decoder's answer to turn 1"):
        resolve(prompts, 1, lambda index: None)
    ids = resolve(prompts, 1, lambda index: tokenizer.encode("fine"))
    assert ids.token_ids == tuple(tokenizer.encode("a\n\nfine\n\nb"))

    from dtbench.harness.execution.executors import LocalExecutor

    class Sink:
        failed: list = []

        def state(self, group):
            return {}, set()

        def prompt(self, group):
            raise TurnNotReady("question 7 turn 2: missing")

        def fail(self, group, error, worker):
            self.failed.append((group, error))

    executor = LocalExecutor()
    executor.worker = type("W", (), {"info": None, "run": lambda *a: pytest.fail("must not run")})()
    sink = Sink()
    executor.execute(["g1"], sink)
    assert sink.failed == [("g1", "question 7 turn 2: missing")]


def test_validate_reads_question_files_from_data_dir(tmp_path, monkeypatch):
    """`dtbench validate --data-dir DIR` checks a question dataset where `dtbench run --data-dir DIR` would read it:
    the categories a suite selects must exist in DIR's file."""
    monkeypatch.delenv("DTBENCH_DATA_DIR", raising=False)
    target, draft = tiny_pair(tmp_path)
    (tmp_path / "data" / "spec-bench").mkdir(parents=True)
    _jsonl(tmp_path / "data" / "spec-bench" / "question.jsonl", USER_QUESTIONS)
    suite = write_suite(
        tmp_path,
        {
            "name": "v",
            "seed": 0,
            "device": "cpu",
            "target": {"model": str(target)},
            "draft": {"model": str(draft)},
            "datasets": [{"name": "spec-bench", "categories": ["poetry"], "prompts": 2, "warmup": 1, "L_max": 120}],
            "generation_lengths": [8],
            "chat_template": "none",
            "decoders": [{"name": "ar"}],
        },
    )
    ok = invoke("validate", suite, "--data-dir", str(tmp_path / "data"))
    assert ok.exit_code == 0 and ": ok" in ok.stdout, ok.output
    one_line_error(
        invoke("validate", suite, "--data-dir", str(tmp_path / "empty")),
        "question.jsonl not found",
        str(tmp_path / "empty"),
    )
    monkeypatch.setenv("DTBENCH_DATA_DIR", str(tmp_path / "data"))  # the option's environment variable
    assert invoke("validate", suite).exit_code == 0
