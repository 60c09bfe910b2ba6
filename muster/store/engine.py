"""Opening the database: SQLite (WAL) in the user's data dir by default, PostgreSQL by URL.

Every open brings the schema up to head with the alembic migrations, so a new file or an
empty PostgreSQL database is ready at once and an older one is upgraded in place (an open
that finds head stored skips alembic).

Two kinds of transaction: ``Database.transaction()`` for work that writes (on SQLite it
takes the write lock up front, BEGIN IMMEDIATE) and ``Database.read()`` for work that only
reads (a deferred BEGIN on SQLite, so in WAL mode it never waits for a writer; READ ONLY on
PostgreSQL). A directory or SQLite file muster creates is private to the user (0700, 0600;
SQLite gives the -wal and -shm files the database file's mode).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import platformdirs
from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from muster.errors import StoreUnavailable, UserError

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS = Path(__file__).parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 10_000  # the longest any write waits for another writer
READ_ONLY_OPTION = "muster_read_only"  # execution option: begin a read-only transaction


def data_dir() -> Path:
    """Where muster keeps its database and artifacts (MUSTER_DATA_DIR overrides)."""
    override = os.environ.get("MUSTER_DATA_DIR")
    return Path(override) if override else Path(platformdirs.user_data_dir("muster"))


def ensure_data_dir() -> Path:
    """``data_dir()``, created private to the user (0700) when it does not exist yet."""
    return make_private_dir(data_dir(), existing_too=True)


def make_private_dir(path: Path, *, existing_too: bool = False) -> Path:
    """Create ``path`` (and missing parents) as 0700. An existing directory is left as it is
    (it may be /tmp), unless ``existing_too`` (muster's own data dir, made by an older
    muster that did not restrict it)."""
    if not path.is_dir():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.chmod(0o700)  # mkdir's mode is cut by the umask; 0700 is what we mean
    elif existing_too:
        _owner_only(path, 0o700)
    return path


def _owner_only(path: Path, mode: int) -> None:
    try:
        st = path.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o777 != mode:
            path.chmod(mode)
    except OSError:
        pass  # not ours to change, or gone: the open that follows says what is wrong


def _create_private_file(path: Path) -> None:
    """Create an empty ``path`` as 0600 unless it exists (an empty file is an empty database)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        _owner_only(path, 0o600)  # an older muster's database: it holds the secrets too
        return
    os.fchmod(fd, 0o600)
    os.close(fd)


def default_url() -> str:
    return f"sqlite:///{data_dir() / 'muster.db'}"


def normalize_url(url: str) -> str:
    """Accept 'postgresql://' (use psycopg 3), 'sqlite:///path' or a bare file path."""
    if "://" not in url:
        return f"sqlite:///{Path(url).expanduser().resolve()}"
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def make_engine(url: str | None = None, **kwargs: Any) -> Engine:
    """An engine with muster's connection settings; does not migrate."""
    raw = normalize_url(url or default_url())
    try:
        parsed = make_url(raw)
    except ArgumentError as exc:
        raise UserError(
            f"--db {url!r} is not a database URL; use a file path, sqlite:///PATH "
            "or postgresql://user:password@host/db"
        ) from exc
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:" and "mode=memory" not in raw:
            parent = Path(parsed.database).parent
            make_private_dir(parent, existing_too=parent == data_dir())
            _create_private_file(Path(parsed.database))
        engine = create_engine(
            parsed, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, **kwargs
        )
        event.listen(engine, "connect", _sqlite_connect)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    if parsed.get_backend_name() == "postgresql":
        try:
            import psycopg  # noqa: F401
        except ImportError as exc:
            raise UserError(
                "PostgreSQL needs the psycopg driver: pip install 'muster[postgres]'"
            ) from exc
        engine = create_engine(parsed, pool_pre_ping=True, **kwargs)
        event.listen(engine, "connect", _postgres_connect)
        return engine
    raise UserError(
        f"--db {parsed.get_backend_name()!r} is not supported; use SQLite or PostgreSQL"
    )


def _postgres_connect(dbapi_connection: Any, _record: Any) -> None:
    # Times are stored as timestamptz and read back in the session's time zone, which PGTZ or
    # the server's TimeZone may set to anything: in UTC, GET /v1/jobs (formatted by the
    # database) and GET /v1/jobs/{id} (by Python) say the same. Committed, or the pool's
    # rollback on check-in would undo the SET.
    with dbapi_connection.cursor() as cursor:
        cursor.execute("SET TIME ZONE 'UTC'")
    dbapi_connection.commit()


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # Let SQLAlchemy's "begin" event issue BEGIN IMMEDIATE itself: a transaction that will
    # write takes the write lock up front instead of failing to upgrade a read lock later.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.close()


def _sqlite_begin(connection: Any) -> None:
    if connection.get_execution_options().get(READ_ONLY_OPTION):
        connection.exec_driver_sql("BEGIN")  # deferred: a reader in WAL mode takes no lock
    else:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


# The newest revision under migrations/versions (tests/store/test_migrations.py holds it to
# alembic's head). An open that finds it stored needs no alembic: its imports alone took
# 0.3-0.4 s of every `muster server`, `muster token` and agent start.
SCHEMA_HEAD = "0003"


def alembic_config() -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def stored_revision(engine: Engine) -> str | None:
    """The revision alembic_version holds; None for a new database. Read without the write
    lock (a deferred BEGIN on SQLite: a writer elsewhere does not hold it up)."""
    options: dict[str, Any] = {READ_ONLY_OPTION: True}
    if engine.dialect.name == "postgresql":
        options["postgresql_readonly"] = True
    try:
        with engine.connect().execution_options(**options) as connection:
            if not inspect(connection).has_table("alembic_version"):
                return None
            row = connection.execute(text("SELECT version_num FROM alembic_version")).first()
    except DBAPIError as exc:  # no server, no access, or a file that is no database
        raise _unavailable(engine, exc) from exc
    return str(row[0]) if row is not None else None


def _unavailable(engine: Engine, exc: DBAPIError) -> StoreUnavailable:
    check = (
        "that the server is running and the user may read it"
        if engine.dialect.name == "postgresql"
        else "that the file is muster's database"
    )
    return StoreUnavailable(
        f"cannot open the database at {engine.url.render_as_string(hide_password=True)}: "
        f"{exc.orig}; check --db and {check}"
    )


def migrate(engine: Engine) -> None:
    """Upgrade the database to the newest schema (no-op when it is current)."""
    if stored_revision(engine) == SCHEMA_HEAD:
        return
    from alembic import command

    config = alembic_config()
    try:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
    except DBAPIError as exc:
        raise _unavailable(engine, exc) from exc


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


_WRITERS: dict[str, threading.RLock] = {}
_WRITERS_GUARD = threading.Lock()


def _sqlite_writers(database: str) -> threading.RLock:
    """One lock per SQLite file in this process, whichever Database opened it."""
    with _WRITERS_GUARD:
        return _WRITERS.setdefault(database, threading.RLock())


class Database:
    """An engine plus sessions; every unit of work is one transaction."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        options: dict[str, Any] = {READ_ONLY_OPTION: True}
        if engine.dialect.name == "postgresql":
            options["postgresql_readonly"] = True
        self._read_sessions = sessionmaker(
            engine.execution_options(**options), expire_on_commit=False
        )
        # SQLite has one writer at a time, and a writer that finds the lock taken polls
        # for it, sleeping 1, 2, 5 ... up to 100 ms between tries: under load (the group
        # commit, a pass's reservation and the API's submits) those sleeps added up to
        # 20 s over a 22 s run of bench/control_plane.py, one wait of 1 s. This process's
        # writers queue here instead, each starting the moment the last one commits
        # (12 s in all, 0.12 s at most); another process (muster gc) still meets the
        # busy timeout.
        self._writers = (
            _sqlite_writers(engine.url.database or "") if engine.dialect.name == "sqlite" else None
        )

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """One transaction that may write: committed on success, rolled back on any error."""
        if self._writers is None:
            with self._begin(self._sessions) as session:
                yield session
            return
        # As long as SQLite itself would wait for another writer: a queue of writers behind
        # one stuck on the file fails each after that, not in turn. (Then BEGIN IMMEDIATE
        # still waits up to the busy timeout for another process that holds the file.)
        if not self._writers.acquire(timeout=SQLITE_BUSY_TIMEOUT_MS / 1000):
            raise StoreUnavailable(
                f"database error: waited {SQLITE_BUSY_TIMEOUT_MS / 1000:g} s for another "
                "writer of this process (database is locked)"
            )
        try:
            with self._begin(self._sessions) as session:
                yield session
        finally:
            self._writers.release()

    @contextmanager
    def read(self) -> Iterator[Session]:
        """One transaction that only reads; it does not wait for writers (see the top)."""
        with self._begin(self._read_sessions) as session:
            yield session

    @contextmanager
    def _begin(self, sessions: sessionmaker[Session]) -> Iterator[Session]:
        session = sessions()
        try:
            with session.begin():
                yield session
        except OperationalError as exc:
            raise StoreUnavailable(f"database error: {exc.orig}") from exc
        finally:
            session.close()

    def dispose(self) -> None:
        self.engine.dispose()


def open_database(url: str | None = None, **kwargs: Any) -> Database:
    """Open (creating and migrating as needed) the database at ``url``."""
    engine = make_engine(url, **kwargs)
    migrate(engine)
    return Database(engine)
