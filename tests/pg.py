"""A throwaway PostgreSQL server for the database tests.

``DTBENCH_TEST_POSTGRES_URL`` (a URL whose user may CREATE DATABASE, e.g. postgresql+psycopg://postgres@host/postgres)
names an existing server; otherwise a cluster is made with ``initdb`` in a temporary folder and started with
``pg_ctl`` on a free localhost port (binaries from PATH or /usr/lib/postgresql/*/bin). The server refuses to run
as root: when the tests run as root it runs as the ``postgres`` user (``runuser``). Each test gets a database of
its own. :func:`unavailable` says why no server can be had (the tests then skip with that reason).
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

ENV = "DTBENCH_TEST_POSTGRES_URL"


def find_binary(name: str) -> str | None:
    """``name`` on PATH, else the newest /usr/lib/postgresql/*/bin/``name``."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(
        glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    return candidates[-1] if candidates else None


def unavailable() -> str | None:
    """Why no PostgreSQL server can be used for the tests, or None when one can."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'dtbench[postgres]')"
    if os.environ.get(ENV):
        return None
    if not (find_binary("initdb") and find_binary("pg_ctl")):
        return f"no PostgreSQL server binaries (initdb, pg_ctl) on PATH or in /usr/lib/postgresql, and no ${ENV}"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run the server as"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A PostgreSQL server to create test databases on (started by :meth:`start`, stopped by :meth:`stop`)."""

    def __init__(self) -> None:
        self.admin_url = os.environ.get(ENV)
        self.tmp: Path | None = None
        self.port: int | None = None
        self._names = itertools.count()

    def _as_server_user(self, cmd: list[str]) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd

    def start(self) -> Server:
        if self.admin_url:
            return self
        self.tmp = Path(tempfile.mkdtemp(prefix="dtbench-pg-"))
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.tmp, user.pw_uid, user.pw_gid)
        data = self.tmp / "data"
        subprocess.run(
            self._as_server_user(
                [
                    find_binary("initdb"),
                    "-D",
                    str(data),
                    "-A",
                    "trust",
                    "-U",
                    "postgres",
                    "-E",
                    "UTF8",
                    "--no-sync",
                    "--no-instructions",
                ]
            ),
            check=True,
            capture_output=True,
            text=True,
        )
        for _ in range(5):
            self.port = _free_port()
            opts = f"-p {self.port} -k {self.tmp} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50"
            done = subprocess.run(
                self._as_server_user(
                    [
                        find_binary("pg_ctl"),
                        "-D",
                        str(data),
                        "-o",
                        opts,
                        "-l",
                        str(self.tmp / "server.log"),
                        "-w",
                        "-t",
                        "60",
                        "start",
                    ]
                ),
                capture_output=True,
                text=True,
            )
            if done.returncode == 0:
                break
        else:
            log = (self.tmp / "server.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"pg_ctl start failed: {done.stderr.strip()} {log}")
        self.admin_url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        return self

    def stop(self) -> None:
        if self.tmp is None:
            return
        subprocess.run(
            self._as_server_user(
                [find_binary("pg_ctl"), "-D", str(self.tmp / "data"), "-m", "immediate", "-w", "stop"]
            ),
            capture_output=True,
            text=True,
        )
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp = None

    def new_database(self) -> str:
        """Create an empty database; return its SQLAlchemy URL."""
        import psycopg
        from sqlalchemy.engine import make_url

        admin = make_url(self.admin_url)
        name = f"dtbench_test_{os.getpid()}_{next(self._names)}"
        conninfo = admin.set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(conninfo, autocommit=True) as con:
            con.execute(f'DROP DATABASE IF EXISTS "{name}"')
            con.execute(f'CREATE DATABASE "{name}"')
        return admin.set(database=name).render_as_string(hide_password=False)
