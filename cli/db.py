"""``dtbench db``: the results database's schema: ``upgrade`` it to this dtbench's revision, show the ``current`` one.

Registered in ``cli/main.py`` with ``cli.add_command(db_group)``; errors are DtbenchError, which the main group
turns into one line on stderr and exit code 2.
"""

from __future__ import annotations

import click

DB_HELP = "SQLAlchemy URL or SQLite file of the results database [env DTBENCH_DB; default sqlite:///results.db]"


@click.group("db")
def db_group() -> None:
    """The results database's schema (Alembic migrations shipped with dtbench).

    \b
    dtbench db upgrade [--db URL]   create the database, or upgrade it to this dtbench's schema revision
    dtbench db current [--db URL]   show its revision (read only)

    `dtbench run` upgrades an older database by itself (with a note); read-only commands such as `dtbench report`
    refuse one and say to run `dtbench db upgrade`.
    """


@db_group.command("upgrade")
@click.option("--db", "db_url", help=DB_HELP)
def upgrade(db_url) -> None:
    """Create the database at the newest schema revision, or upgrade it (safe while other processes start)."""
    from dtbench.harness.store import engines, schema

    url = engines.resolve_url(db_url)
    engines.writer_engine(url).dispose()  # a malformed URL or a missing driver: one line before anything else
    before, after = schema.ensure_current(url, note=None)
    where = engines.display_url(url)
    if before is None:
        click.echo(f"{where}: created at schema revision {after} (head)")
    elif before == after:
        click.echo(f"{where}: already at schema revision {after} (head)")
    else:
        click.echo(f"{where}: upgraded from schema revision {before} to {after} (head)")


@db_group.command("current")
@click.option("--db", "db_url", help=DB_HELP)
def current(db_url) -> None:
    """Show the database's schema revision and whether it is this dtbench's (read only; exit 2 if not usable)."""
    from dtbench.harness.store import engines, schema

    url = engines.resolve_url(db_url)
    engine = engines.reader_engine(url)
    try:
        state = schema.current(engine, url)
    finally:
        engine.dispose()
    where = engines.display_url(url)
    head = schema.head()
    if state.kind in ("new", "foreign"):
        raise schema.not_ours(where, state)
    if state.revision == head:
        click.echo(f"{where}: schema revision {head} (head)")
    elif state.kind == "versioned" and state.revision not in schema.revisions():
        raise schema.newer(where, str(state.revision))
    else:
        unversioned = " (written before migrations: no alembic_version table)" if state.kind == "unversioned" else ""
        click.echo(
            f"{where}: schema revision {state.revision}{unversioned}, older than head {head}: "
            f"{schema.upgrade_instruction(url)}"
        )
