"""The portal page where a person creates, lists and revokes their personal access tokens.

Thin: api.tokens issues and revokes (and audits). A new token's secret is rendered in the
response to the creating POST only; it is never put in the session, a message or a redirect.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from api import tokens
from api.forms import TokenForm
from api.models import PersonalAccessToken
from tenants import access


def _page(request, form, *, created=None, secret=None, status=200):
    return render(request, "api/token_list.html", {
        "form": form, "tokens": PersonalAccessToken.objects.filter(user=request.user),
        "created": created, "secret": secret,
    }, status=status)


@login_required
@require_http_methods(["GET", "POST"])
def token_list(request):
    if access.is_vendor_only(request.user):
        raise Http404  # a vendor reaches its work order's nodes and cards only, never the API
    if request.method == "POST":
        form = TokenForm(request.POST)
        if form.is_valid():
            try:
                token, secret = tokens.create_token(request.user, name=form.cleaned_data["name"],
                                                    scope=form.cleaned_data["scope"],
                                                    days=form.cleaned_data["expires_in_days"])
            except ValidationError as exc:
                for field, errors in exc.message_dict.items():
                    form.add_error(field if field in form.fields else None, errors)
            else:
                response = _page(request, TokenForm(), created=token, secret=secret)
                response["Cache-Control"] = "no-store"
                return response
        return _page(request, form, status=400)
    return _page(request, TokenForm())


@login_required
@require_POST
def token_revoke(request, pk: int):
    token = PersonalAccessToken.objects.filter(user=request.user, pk=pk).first()
    if token is None:
        raise Http404
    try:
        tokens.revoke_token(request.user, token)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, f"Token {token.prefix}… revoked; it stops working at its next use.")
    return redirect("api_token_list")
