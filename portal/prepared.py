"""Hand-written SQL for hot paths, prepared once per PostgreSQL connection.

Every gateway call runs the same two statements (the key check and the metering write), and
every page the same permission statement (tenants.access.prime). The
ORM compiles each query anew (more CPU than the query costs to run), and PostgreSQL plans
each anew (the key check's permission joins took ~3 ms to plan and 0.2 ms to run). A
`Statement` is written once with named parameters and runs on a psycopg cursor with
server-side binding and `prepare=True`: psycopg prepares it the first time a connection runs
it and then only binds values (no SQL text to quote and parse, no planning); a new connection
prepares again by itself. On SQLite (development) the same text runs as a plain query.

The cursor is wrapped by Django's own cursor wrapper, so errors are django.db errors and the
statements are logged and counted like any other query. Values are always parameters; only
identifiers taken from model metadata are written into the text. This module never caches a
result.
"""

from __future__ import annotations

from contextlib import contextmanager

import psycopg
from django.db import connection
from django.db.backends.utils import CursorDebugWrapper

# Django opens connections with prepare_threshold=None (psycopg never prepares); a threshold no
# query reaches lets psycopg prepare exactly what a _PreparingCursor runs. Django's own cursors
# bind on the client side and are never prepared, whatever the threshold.
_EXPLICIT_ONLY = 2**31


class _PreparingCursor(psycopg.Cursor):
    def execute(self, query, params=None, *, prepare=None, binary=None):
        return super().execute(query, params, prepare=True, binary=binary)


class _DebugWrapper(CursorDebugWrapper):
    # psycopg keeps no text of a prepared query for Django's last_executed_query: log the
    # statement as written (parameters as %(name)s) instead of None
    @contextmanager
    def debug_sql(self, sql=None, params=None, use_last_executed_query=False, many=False):
        with super().debug_sql(sql, params, use_last_executed_query=False, many=many):
            yield


def _cursor():
    """What connection.cursor() does, with a server-binding cursor that prepares its statements."""
    if connection.vendor != "postgresql":
        return connection.cursor()
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    connection.validate_thread_sharing()
    with connection.wrap_database_errors:
        if connection.connection.prepare_threshold is None:
            connection.connection.prepare_threshold = _EXPLICIT_ONLY
        raw = _PreparingCursor(connection.connection)
    return _DebugWrapper(raw, connection) if connection.queries_logged else connection.make_cursor(raw)


class Statement:
    def __init__(self, build):
        """`build()` returns the SQL with %(name)s parameters; called once, after the models load."""
        self.build = build
        self._sql: str | None = None

    def fetchone(self, values: dict):
        with _cursor() as cur:
            # nosemgrep: atrium-raw-sql-string-formatting -- identifiers from model metadata, values are parameters
            cur.execute(self.sql, values)
            return cur.fetchone()

    def fetchall(self, values: dict) -> list:
        with _cursor() as cur:
            # nosemgrep: atrium-raw-sql-string-formatting -- identifiers from model metadata, values are parameters
            cur.execute(self.sql, values)
            return cur.fetchall()

    @property
    def sql(self) -> str:
        if self._sql is None:
            self._sql = self.build()
        return self._sql


def select_columns(model, alias: str) -> str:
    """Every concrete column of `model`, qualified by `alias`, in Model.from_db's order."""
    return ", ".join(f'{alias}."{f.column}"' for f in model._meta.concrete_fields)


def from_row(model, values):
    """A model instance from the values of `select_columns(model, ...)`, as the ORM would build it."""
    fields = model._meta.concrete_fields
    if connection.vendor != "postgresql":  # SQLite answers text for dates and times: the ORM's converters
        values = [_converted(model, f, v) for f, v in zip(fields, values, strict=True)]
    return model.from_db(connection.alias, [f.attname for f in fields], values)


def _converted(model, field, value):
    col = field.get_col(model._meta.db_table)
    for convert in connection.ops.get_db_converters(col) + field.get_db_converters(connection):
        value = convert(value, col, connection)
    return value
