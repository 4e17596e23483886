"""Form helpers every app's views share."""

from __future__ import annotations

from django.core.exceptions import ValidationError


def add_service_errors(form, exc: ValidationError) -> None:
    """Put a service's ValidationError on the form field it names (or on the whole form), so a
    refusal from the service reads like any other field error."""
    if hasattr(exc, "error_dict"):
        for field, errors in exc.message_dict.items():
            form.add_error(field if field in form.fields else None, errors)
    else:
        form.add_error(None, exc.messages)
