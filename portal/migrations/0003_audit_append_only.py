"""On PostgreSQL, a trigger refuses UPDATE and DELETE on the audit table (append-only even
for someone who bypasses the ORM with the application's own database role).

TRUNCATE stays possible on purpose: it is how a test database is emptied between tests, and
a role that may TRUNCATE may also drop the trigger; the hash chain is what proves tampering."""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION atrium_audit_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'portal_auditevent is append-only (%% refused)', TG_OP;
END;
$$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS atrium_audit_append_only ON portal_auditevent;
CREATE TRIGGER atrium_audit_append_only BEFORE UPDATE OR DELETE ON portal_auditevent
    FOR EACH ROW EXECUTE FUNCTION atrium_audit_append_only();
"""

DROP = """
DROP TRIGGER IF EXISTS atrium_audit_append_only ON portal_auditevent;
DROP FUNCTION IF EXISTS atrium_audit_append_only();
"""


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("portal", "0002_initial")]
    operations = [migrations.RunPython(forwards, backwards)]
