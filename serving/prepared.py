"""Hand-written SQL for the gateway's hot path, prepared once per PostgreSQL connection.

Every gateway call runs the same two statements (the key check and the metering write). The
ORM compiles each query anew (more CPU than the query costs to run), and PostgreSQL plans
each anew (the key check's permission joins took ~3 ms to plan and 0.2 ms to run). A
`Statement` is written once with named parameters, sent as `PREPARE name(types) AS ...` the
first time a connection runs it, then as `EXECUTE name(...)`: no compilation, no planning.
Prepared statements outlive a rolled-back transaction and end with their session, so the set
of prepared names is kept on the psycopg connection object itself and a new connection
prepares again. On SQLite (development) the same text runs as a plain parameterised query.

Statements go through Django's cursor (errors are django.db errors, queries are logged and
counted like any other). Values are always parameters; only identifiers taken from model
metadata are written into the text. This module never caches a result.
"""

from __future__ import annotations

import re

from django.db import connection

_PARAM = re.compile(r"%\((\w+)\)s")


class Statement:
    def __init__(self, name: str, build, types: dict[str, str]):
        """`build()` returns the SQL with %(name)s parameters (called once, after the models
        are loaded); `types` gives each parameter's PostgreSQL type, in any order."""
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            raise ValueError(f"bad statement name {name!r}")
        self.name, self.build, self.types = name, build, types
        self._sql: str | None = None
        self._order: list[str] = []
        self._prepare = self._execute = ""

    def _compile(self) -> None:
        sql = self.build()
        order: list[str] = []

        def number(m: re.Match) -> str:
            if m.group(1) not in order:
                order.append(m.group(1))
            return f"${order.index(m.group(1)) + 1}"

        pg = _PARAM.sub(number, sql)
        missing = set(order) ^ set(self.types)
        if missing:
            raise ValueError(f"statement {self.name}: parameters and types differ on {sorted(missing)}")
        self._prepare = f"PREPARE {self.name}({', '.join(self.types[p] for p in order)}) AS {pg}"
        self._execute = f"EXECUTE {self.name}({', '.join(['%s'] * len(order))})"
        self._order = order
        self._sql = sql

    def run(self, cursor, values: dict):
        """Execute on `cursor` (a django.db cursor of the default connection); returns the cursor."""
        if self._sql is None:
            self._compile()
        if connection.vendor != "postgresql":
            cursor.execute(self._sql, values)
            return cursor
        raw = connection.connection
        ready = getattr(raw, "_atrium_prepared", None)
        if ready is None:
            ready = raw._atrium_prepared = set()
        if self.name not in ready:
            cursor.execute(self._prepare)
            ready.add(self.name)
        cursor.execute(self._execute, [values[p] for p in self._order])
        return cursor


def select_columns(model, alias: str) -> str:
    """Every concrete column of `model`, qualified by `alias`, in Model.from_db's order."""
    return ", ".join(f'{alias}."{f.column}"' for f in model._meta.concrete_fields)


def from_row(model, values):
    """A model instance from the values of `select_columns(model, ...)`, as the ORM would build it."""
    return model.from_db(connection.alias, [f.attname for f in model._meta.concrete_fields], values)
