"""One benchmark prompt as every part of a run passes it around (datasets, question datasets, the worker, the
samples row): a plain frozen dataclass, imported by :mod:`dtbench.harness.data.datasets` and :mod:`dtbench.harness.data.questions`
alike so neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: its index in the selection, source document, and token ids (at most L_max).

    Question datasets (:mod:`dtbench.harness.data.questions`) also say which task the prompt belongs to: ``task_group``
    (a Spec-Bench group, or the raw category the suite selected), ``category`` (the question's raw category),
    ``turn`` (1-based) and ``question_id``; a later turn's ``token_ids`` are empty until its turn is dispatched
    (:func:`dtbench.harness.data.chat.resolve` renders them from the reference's earlier answers).
    """

    index: int
    document: str
    token_ids: tuple[int, ...]
    task_group: str | None = None
    category: str | None = None
    turn: int | None = None
    question_id: str | None = None
