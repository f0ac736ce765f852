"""What reports need on each cell, sampling settings, and the paper's conventions for old samples.

cells: sweep_group (the label of the sweep entry a cell is one point of), swept (its point of that grid, JSON),
sampling (temperature/top_k/top_p/seed, JSON; NULL: greedy). Reports used to re-parse the stored suite text to
find sweep points; this revision does that once, for the cells written before it, with the label rule dtbench
has always used (``"<entry label> (k1=v1, k2=v2)"``, keys in the sweep's order).

samples: acceptance_incl_bonus and mean_path_length_all (added empty by 0002) are computed for old rows from the
per-step data every sample has stored since 0001 (step_tokens, step_stats.accepted and .depth), so an old run
reports the paper's Table 3 conventions as a new one does.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

import itertools
import json
from typing import Any

import sqlalchemy as sa
import yaml
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _sweep_points(suite_text: str) -> dict[str, tuple[str | None, dict[str, Any]]]:
    """label -> (sweep entry label, point) for every sweep point a stored suite expanded to; {} if unreadable."""
    try:
        data = yaml.safe_load(suite_text or "")
    except yaml.YAMLError:
        return {}
    out: dict[str, tuple[str | None, dict[str, Any]]] = {}
    for entry in (data or {}).get("decoders") or [] if isinstance(data, dict) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("sweep"), dict) or not entry["sweep"]:
            continue
        display = entry.get("label") or entry.get("name")
        keys = list(entry["sweep"])
        for values in itertools.product(*(entry["sweep"][k] for k in keys)):
            point = dict(zip(keys, values))
            out[f"{display} ({', '.join(f'{k}={v}' for k, v in point.items())})"] = (display, point)
    return out


def _loads(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def upgrade() -> None:
    with op.batch_alter_table("cells") as batch:
        batch.add_column(sa.Column("sweep_group", sa.String(length=300), nullable=True))
        batch.add_column(sa.Column("swept", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("sampling", sa.JSON(), nullable=True))
    bind = op.get_bind()
    cells = sa.table("cells", sa.column("id"), sa.column("run_id"), sa.column("label"),
                     sa.column("sweep_group", sa.String()), sa.column("swept", sa.JSON()))
    runs = sa.table("runs", sa.column("id"), sa.column("suite_text"))
    for run_id, text in bind.execute(sa.select(runs.c.id, runs.c.suite_text)).all():
        points = _sweep_points(text)
        if not points:
            continue
        for cell_id, label in bind.execute(sa.select(cells.c.id, cells.c.label).where(cells.c.run_id == run_id)):
            if label in points:
                group, point = points[label]
                bind.execute(cells.update().where(cells.c.id == cell_id).values(sweep_group=group, swept=point))
    samples = sa.table("samples", sa.column("id"), sa.column("step_tokens", sa.JSON()),
                       sa.column("step_stats", sa.JSON()), sa.column("iterations"),
                       sa.column("acceptance_incl_bonus", sa.Float()), sa.column("mean_path_length_all", sa.Float()))
    rows = bind.execute(sa.select(samples.c.id, samples.c.step_tokens, samples.c.step_stats, samples.c.iterations)
                        .where(samples.c.acceptance_incl_bonus.is_(None), samples.c.mean_path_length_all.is_(None)))
    for sample_id, step_tokens, step_stats, iterations in rows.all():
        tokens, stats = _loads(step_tokens) or [], _loads(step_stats) or {}
        depth, accepted = stats.get("depth") or [], stats.get("accepted") or []
        drafting = [i for i, d in enumerate(stats.get("drafted") or []) if d > 0]
        if not drafting or len(tokens) != len(depth) or len(accepted) != len(depth) or not sum(depth):
            continue
        bind.execute(samples.update().where(samples.c.id == sample_id).values(
            acceptance_incl_bonus=sum(tokens[i] for i in drafting) / sum(depth),
            mean_path_length_all=sum(accepted) / iterations))


def downgrade() -> None:
    with op.batch_alter_table("cells") as batch:
        for name in ("sampling", "swept", "sweep_group"):
            batch.drop_column(name)
