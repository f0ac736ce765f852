"""Frozen column sets of the schema before migrations: revision 0001's tables and the interim columns.

Migration data, not the current schema (that is :mod:`dtbench.harness.store.db`): :mod:`dtbench.harness.store.schema`
recognises a database written before migrations existed (no ``alembic_version`` table) by these columns and stamps it
with :data:`BASELINE_REVISION` before upgrading it. They never change: a new column is a new revision in
``versions/``. Alembic loads only ``env.py`` and ``versions/`` from this folder; this module is imported as
``dtbench.harness.store.migrations.baseline``.
"""

from __future__ import annotations

BASELINE_REVISION = "0001"
# The columns of revision 0001 (versions/0001_initial.py: the ORM models of db.py before migrations existed): how an
# unversioned database is recognised.
BASELINE_COLUMNS: dict[str, set[str]] = {
    "runs": {
        "id",
        "suite_name",
        "suite_path",
        "suite_text",
        "suite_hash",
        "status",
        "started_at",
        "finished_at",
        "environment",
        "error",
    },
    "cells": {
        "id",
        "run_id",
        "dataset",
        "prompt_cap",
        "gen_length",
        "decoder",
        "label",
        "decoder_version",
        "decoder_distribution",
        "params",
        "lossless_expected",
        "reference_label",
        "target_model",
        "draft_model",
        "status",
        "error",
    },
    "samples": {
        "id",
        "cell_id",
        "prompt_index",
        "document",
        "warmup",
        "prompt_tokens",
        "new_tokens",
        "total_s",
        "ttft_s",
        "tpot_s",
        "throughput",
        "iterations",
        "tokens_per_iteration",
        "drafted",
        "accepted",
        "draft_depth",
        "acceptance_rate",
        "mean_path_length",
        "target_forwards",
        "step_tokens",
        "step_stats",
        "step_times_s",
        "peak_rss_bytes",
        "peak_allocated_bytes",
        "peak_nvml_bytes",
        "output_hash",
        "output_tokens",
        "lossless",
        "first_divergence",
        "created_at",
    },
}
# Columns that dtbench between commit 3c3e168 and the migrations added with create_all, without alembic_version:
# such a database is stamped 0001 as well, and revision 0002 adds only what it lacks.
INTERIM_COLUMNS: dict[str, set[str]] = {
    "runs": {"owner_host", "owner_pid", "heartbeat_at"},
    "cells": set(),
    "samples": {"draft_forwards", "acceptance_incl_bonus", "mean_path_length_all", "nvml_scope"},
}
