"""GIN index on Chunk.search_vector: created on PostgreSQL only (SQLite demo has no tsvector)."""

import django.contrib.postgres.indexes
from django.db import migrations

INDEX = "serving_chunk_search_gin"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        # nosemgrep: atrium-raw-sql-string-formatting -- INDEX is this module's constant
        schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {INDEX} ON serving_chunk USING gin (search_vector)")


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        # nosemgrep: atrium-raw-sql-string-formatting -- INDEX is this module's constant
        schema_editor.execute(f"DROP INDEX IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    dependencies = [("serving", "0001_initial")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="chunk",
                    index=django.contrib.postgres.indexes.GinIndex(fields=["search_vector"], name=INDEX),
                ),
            ],
            database_operations=[migrations.RunPython(create, drop)],
        ),
    ]
