"""The one rule for pages and fragments: the same URL renders the full page, or only the
fragment for an htmx request, from the same context."""

from django.shortcuts import render


def render_page(request, template: str, context: dict, *, fragment: str | None = None, status: int = 200):
    if fragment and getattr(request, "htmx", False) and not request.htmx.boosted:
        return render(request, fragment, context, status=status)
    return render(request, template, context, status=status)
