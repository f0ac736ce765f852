"""Question datasets (chat workloads): Spec-Bench's question file, or any jsonl with the same fields.

Spec-Bench (Xia et al. 2024, hemingkx/Spec-Bench, ``data/spec_bench/question.jsonl``) holds 480 questions, one JSON
object a line: ``question_id``, ``category``, ``turns`` (the user turns). Its six task groups, as its
``evaluation/speed.py`` reports them: ``mt_bench`` (the 80 two-turn MT-bench questions: writing, roleplay,
reasoning, math, coding, extraction, stem, humanities), ``translation``, ``summarization``, ``qa``,
``math_reasoning`` and ``rag`` (80 single-turn questions each). :data:`GROUPS` maps each group to its raw categories.

Source precedence for ``spec-bench``: the entry's ``path:`` (a jsonl file: a user's own questions), else
``<data dir>/spec-bench/question.jsonl`` (the entry's ``data_dir:``, ``--data-dir`` or ``DTBENCH_DATA_DIR``), else
the file downloaded from the Spec-Bench repository at the pinned commit :data:`SPEC_BENCH_COMMIT`, its sha256 checked
against :data:`SPEC_BENCH_SHA256` and cached under ``$DTBENCH_CACHE/spec-bench/`` (default ``~/.cache/dtbench``).
``DTBENCH_SPEC_BENCH_URL`` overrides the download address (a mirror; the tests use a server on 127.0.0.1); the
checksum is checked whatever the address.

Selection (:func:`layout`): ``categories:`` names groups and/or raw categories (default: the six groups, in
Spec-Bench's order); every one of them gets N = ``prompts`` questions, chosen by the suite's seed (a seeded shuffle of
that selection's questions in file order), and the first W = ``warmup`` of each are warmup. Each question contributes
one sample per turn, turns consecutive; turn t > 1 is prompted with the chat of the earlier turns, the reference
decoder's answers included (:mod:`dtbench.harness.data.chat`), so it is resolved when its turn is dispatched.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import urllib.request
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from dtbench.harness.errors import DtbenchError, clip
from dtbench.harness.safetext import printable
from dtbench.harness.suites.bounds import MAX_DOCUMENT_BYTES, read_regular_file
from dtbench.harness.suites.suite import DatasetSpec

SPEC_BENCH_COMMIT = "fd2c1cd7d2201ef71db4c5f4e455008f017967bf"
SPEC_BENCH_SHA256 = "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"
SPEC_BENCH_URL = (
    f"https://raw.githubusercontent.com/hemingkx/Spec-Bench/{SPEC_BENCH_COMMIT}/data/spec_bench/question.jsonl"
)
URL_ENV = "DTBENCH_SPEC_BENCH_URL"

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
GROUPS: dict[str, tuple[str, ...]] = {
    "mt_bench": MT_BENCH,
    "translation": ("translation",),
    "summarization": ("summarization",),
    "qa": ("qa",),
    "math_reasoning": ("math_reasoning",),
    "rag": ("rag",),
}
"""Spec-Bench's six task groups (``evaluation/speed.py``) and the raw categories each holds."""


@dataclass(frozen=True)
class Question:
    """One question: ``question_id`` (as a string), raw ``category``, and its user ``turns`` (at least one)."""

    question_id: str
    category: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class Slot:
    """One sample of a question entry: the question, which selection (``group``: a Spec-Bench group, or the raw
    category the suite named) it was drawn for, its turn (1-based) and whether it is warmup."""

    question: Question
    group: str
    turn: int
    warmup: bool


def group_of(category: str) -> str:
    """The Spec-Bench group of a raw category (the category itself when it is in none)."""
    for group, cats in GROUPS.items():
        if category in cats:
            return group
    return category


def parse_questions(text: str, where: str) -> list[Question]:
    """Questions of a jsonl text (one JSON object a line; blank lines skipped).

    Raises:
        DtbenchError: a line that is not a JSON object with ``category`` (a string) and ``turns`` (a non-empty list
            of strings), naming ``where`` and the line number.
    """
    out: list[Question] = []
    seen: dict[str, int] = {}  # question id -> its line
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DtbenchError(f"{where}:{n}: not a JSON object ({exc.msg})") from None
        except RecursionError:  # json's C parser recurses once per [ or {
            raise DtbenchError(f"{where}:{n}: nests too deeply to be a question (a JSON object of strings)") from None
        if not isinstance(row, dict):
            raise DtbenchError(f"{where}:{n}: not a JSON object")
        turns, category = row.get("turns"), row.get("category")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise DtbenchError(f"{where}:{n}: `turns` must be a non-empty list of strings (the user turns)")
        if not isinstance(category, str) or not category:
            raise DtbenchError(f"{where}:{n}: `category` must be a non-empty string")
        for i, turn in enumerate(turns, 1):
            if not turn.strip():  # an empty prompt under chat_template: none, a question of nothing under any
                raise DtbenchError(f"{where}:{n}: turn {i} is empty (every user turn needs text)")
        for field, value in [("category", category), *((f"turn {i}", t) for i, t in enumerate(turns, 1))]:
            bad = _not_utf8(value)
            if bad:  # JSON's \ud800 escape decodes to a lone surrogate, which no tokenizer can encode
                raise DtbenchError(
                    f"{where}:{n}: {field} holds {bad}, which is not text (a lone UTF-16 surrogate escape)"
                )
        raw_id = row.get("question_id", n)
        if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or _not_utf8(str(raw_id)):
            raise DtbenchError(f"{where}:{n}: `question_id` must be a string or an integer")
        qid = str(raw_id)
        if qid in seen:  # reports sum a question's turns by its id: two questions of one id would merge
            raise DtbenchError(
                f"{where}:{n}: question_id {printable(clip(qid, 60))} is also the question_id of line "
                f"{seen[qid]}; question ids must be unique"
            )
        seen[qid] = n
        out.append(Question(qid, category, tuple(turns)))
    if not out:
        raise DtbenchError(f"{where}: holds no questions")
    return out


def _not_utf8(text: str) -> str | None:
    """The first character of ``text`` that UTF-8 cannot encode (a lone surrogate) as ``\\udXXX``, or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"\\u{ord(text[exc.start]):04x}"
    return None


def _cache_dir() -> Path:
    return Path(os.environ.get("DTBENCH_CACHE") or Path.home() / ".cache" / "dtbench") / "spec-bench"


def download(url: str | None = None, cache: Path | None = None) -> Path:
    """The Spec-Bench question file from the cache, else downloaded at the pinned commit, checked, then cached.

    Args:
        url: where to download from (default ``$DTBENCH_SPEC_BENCH_URL`` or :data:`SPEC_BENCH_URL`).
        cache: the cache folder (default ``$DTBENCH_CACHE/spec-bench``).

    Returns:
        The cached file's path (named by its sha256; written atomically).

    Raises:
        DtbenchError: the download failed or its sha256 is not :data:`SPEC_BENCH_SHA256` (nothing is cached then).
    """
    cache = cache or _cache_dir()
    path = cache / f"question-{SPEC_BENCH_SHA256[:16]}.jsonl"
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == SPEC_BENCH_SHA256:
        return path
    try:  # a cache that cannot hold the file is found before the download, not after it
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DtbenchError(_cache_error(cache, exc)) from None
    url = url or os.environ.get(URL_ENV) or SPEC_BENCH_URL
    try:
        with urllib.request.urlopen(url, timeout=60) as response:  # noqa: S310  (https, or a mirror the user set)
            raw = response.read(64 << 20)
    except Exception as exc:  # noqa: BLE001  (any network failure is one line)
        raise DtbenchError(
            f"spec-bench: cannot download {clip(url, 120)} ({clip(exc, 160)}); offline, point "
            f"--data-dir at a folder holding spec-bench/question.jsonl (e.g. ../shared/data)"
        ) from None
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SPEC_BENCH_SHA256:
        raise DtbenchError(
            f"spec-bench: {clip(url, 120)} has sha256 {digest[:16]}..., not the pinned file's "
            f"{SPEC_BENCH_SHA256[:16]}... (commit {SPEC_BENCH_COMMIT[:12]}); nothing was cached"
        )
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        tmp.write_bytes(raw)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DtbenchError(_cache_error(cache, exc)) from None
    return path


def _cache_error(cache: Path, exc: OSError) -> str:
    why = {
        FileExistsError: "a file, not a folder, is in the way",
        NotADirectoryError: "a file, not a folder, is in its path",
    }.get(type(exc), exc.strerror or type(exc).__name__)
    return (
        f"spec-bench: cannot use the download cache {printable(cache)} ({why}); set DTBENCH_CACHE to a writable "
        f"folder, or point --data-dir at a folder holding spec-bench/question.jsonl"
    )


def question_file(spec: DatasetSpec, data_dir: str | None = None) -> tuple[Path, dict]:
    """Where ``spec``'s questions come from and its provenance (see the module docstring for the precedence).

    Raises:
        DtbenchError: a ``path:`` or data-dir file that does not exist, or a failed download.
    """
    if spec.path:
        path = Path(spec.path).expanduser()
        if not path.is_file():
            raise DtbenchError(f"{spec.name}: question file {spec.path} not found")
        return path, {"source": "local"}
    chosen = spec.data_dir or data_dir or os.environ.get("DTBENCH_DATA_DIR")
    if chosen:
        path = Path(chosen).expanduser() / "spec-bench" / "question.jsonl"
        if not path.is_file():
            raise DtbenchError(f"{spec.name}: {path} not found (data dir {chosen})")
        return path, {"source": "local"}
    return download(), {
        "source": "download",
        "url": os.environ.get(URL_ENV) or SPEC_BENCH_URL,
        "commit": SPEC_BENCH_COMMIT,
    }


@lru_cache(maxsize=16)
def _read(path: str, mtime: float) -> tuple[tuple[Question, ...], str]:
    raw = read_regular_file(Path(path), MAX_DOCUMENT_BYTES, what="question file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DtbenchError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    return tuple(parse_questions(text, path)), hashlib.sha256(raw).hexdigest()


def load_questions(spec: DatasetSpec, data_dir: str | None = None) -> tuple[list[Question], dict]:
    """(questions in file order, provenance with the file's path and sha256).

    Raises:
        DtbenchError: missing or malformed file (one line naming it and the line).
    """
    path, source = question_file(spec, data_dir)
    try:
        questions, digest = _read(str(path.resolve()), path.stat().st_mtime)
    except OSError as exc:
        raise DtbenchError(f"cannot read {path}: {exc.strerror}") from None
    return list(questions), {**source, "files": [str(path.resolve())], "sha256": digest}


def selections(spec: DatasetSpec, questions: list[Question]) -> list[tuple[str, tuple[str, ...]]]:
    """(name, raw categories) of each selection the entry asks for: ``categories:`` (groups or raw categories,
    in the given order), default the six Spec-Bench groups present in the file, else every raw category.

    Raises:
        DtbenchError: a name that is neither a group nor a category of the file, with the available names.
    """
    present = list(dict.fromkeys(q.category for q in questions))
    if spec.categories:
        out = []
        for name in spec.categories:
            if name in GROUPS and any(c in present for c in GROUPS[name]):
                out.append((name, GROUPS[name]))
            elif name in present:
                out.append((name, (name,)))
            else:
                known = sorted({*(g for g, cs in GROUPS.items() if any(c in present for c in cs)), *present})
                raise DtbenchError(
                    f"{spec.name}: unknown category '{printable(clip(name, 60))}' "
                    f"(known: {printable(clip(', '.join(known), 300))})"
                )
        for (a, a_cats), (b, b_cats) in itertools.combinations(out, 2):
            if set(a_cats) & set(b_cats):  # one question measured twice, counted twice in "overall"
                raise DtbenchError(
                    f"{spec.name}: categories name '{printable(a)}' and '{printable(b)}', which share "
                    f"questions; name each question's selection once (--by category breaks a group "
                    f"down)"
                )
        return out
    groups = [(g, cs) for g, cs in GROUPS.items() if any(c in present for c in cs)]
    covered = {c for _, cs in groups for c in cs}
    return groups + [(c, (c,)) for c in present if c not in covered]


def layout(spec: DatasetSpec, seed: int, data_dir: str | None = None) -> list[Slot]:
    """The entry's samples in prompt-index order: per selection, N questions chosen by ``seed``, each turn a sample.

    Raises:
        DtbenchError: bad file or category, or a selection with fewer than N questions.
    """
    questions, _ = load_questions(spec, data_dir)
    slots: list[Slot] = []
    for name, cats in selections(spec, questions):
        pool = [q for q in questions if q.category in cats]
        if len(pool) < spec.prompts:
            raise DtbenchError(f"{spec.name}: '{name}' has {len(pool)} questions, {spec.prompts} asked for (prompts)")
        order = list(range(len(pool)))
        random.Random(f"{seed}:{name}").shuffle(order)
        for rank, i in enumerate(order[: spec.prompts]):
            q = pool[i]
            slots.extend(Slot(q, name, t + 1, rank < spec.warmup) for t in range(len(q.turns)))
    return slots


def prompts(spec: DatasetSpec, l_max: int, tokenizer, suite, data_dir: str | None = None):
    """The entry's prompts at one L_max (:class:`~dtbench.harness.data.chat.ChatPrompts`, in :func:`layout` order): turn 1
    rendered now with the suite's chat template and system prompt, later turns when dispatched
    (:func:`dtbench.harness.data.chat.resolve`).

    Raises:
        DtbenchError: bad file or categories, or ``chat_template: auto`` on a tokenizer without a template.
    """
    from dtbench.harness.data.chat import ChatPrompts, Renderer, suite_template
    from dtbench.harness.data.prompt import Prompt

    mode, template = suite_template(suite, tokenizer)
    renderer = Renderer(tokenizer, template, suite.system_prompt, l_max, mode)
    out, turns = [], {}
    for i, slot in enumerate(layout(spec, suite.seed, data_dir)):
        q = slot.question
        ids = renderer.ids([q.turns[0]], []) if slot.turn == 1 else ()
        out.append(Prompt(i, q.turns[slot.turn - 1][:500], ids, slot.group, q.category, slot.turn, q.question_id))
        turns[i] = q.turns
    return ChatPrompts(out, renderer, turns)


PLACEHOLDER_ANSWER = "(the reference decoder's answer)"


def check_prompts(spec: DatasetSpec, tokenizer, suite, data_dir: str | None = None) -> int:
    """Render every prompt of the entry with the suite's chat template, under :func:`dtbench.harness.data.chat.render`'s
    bounds, before any model loads (validate, and the run's preflight); a later turn with
    :data:`PLACEHOLDER_ANSWER` for each earlier answer (the reference's answers exist only once it ran).

    Returns:
        The number of prompts rendered.

    Raises:
        DtbenchError: a bad file or category; PromptFailed: the template raised, ran too long, grew too large or
            rendered an empty prompt (naming the question and turn).
    """
    from dtbench.harness.data.chat import PromptFailed, Renderer, suite_template

    mode, template = suite_template(suite, tokenizer)
    renderer = Renderer(tokenizer, template, suite.system_prompt, max(spec.l_maxes), mode)
    slots = layout(spec, suite.seed, data_dir)
    for slot in slots:
        q = slot.question
        try:
            renderer.ids(list(q.turns[: slot.turn]), [PLACEHOLDER_ANSWER] * (slot.turn - 1))
        except PromptFailed as exc:
            raise PromptFailed(f"{exc} (question {printable(clip(q.question_id, 60))} turn {slot.turn})") from None
    return len(slots)
