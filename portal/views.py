"""Pages every user shares: home, sign-in and sudo re-authentication, health probes, errors.

Views stay thin: they parse the request, call a service or a restricted queryset, and render.
The health probes answer without a session and never reveal more than which part failed.
"""

from __future__ import annotations

import time

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import authenticate
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import ValidationError
from django.core.validators import MaxLengthValidator
from django.db import connection
from django.http import HttpResponseRedirect, JsonResponse
from django.shortcuts import render
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods

from portal import audit, lockout
from portal.middleware import SUDO_SESSION_KEY
from portal.models import AuditOutcome


@require_GET
def healthz(request):
    return JsonResponse({"status": "ok"})


@require_GET
@never_cache
def readyz(request):
    failing = {}
    try:
        with connection.cursor() as cur:
            cur.execute("SELECT 1")
    except Exception as exc:  # any database error means "not ready"
        failing["database"] = type(exc).__name__
    try:
        import django_rq

        django_rq.get_connection("default").ping()
    except Exception as exc:  # any Redis error means "not ready"
        failing["redis"] = type(exc).__name__
    if failing:
        return JsonResponse({"status": "unavailable", "failing": failing}, status=503)
    return JsonResponse({"status": "ok"})


class AtriumAuthenticationForm(AuthenticationForm):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Django sets the user name's max_length after the field is built, so nothing checks
        # it: an over-long name would reach authenticate() and the throttle's counter column.
        field = self.fields["username"]
        field.validators.append(MaxLengthValidator(field.max_length))

    def confirm_login_allowed(self, user):
        super().confirm_login_allowed(user)
        from tenants.access import is_vendor_only, session_still_valid

        if is_vendor_only(user) and not session_still_valid(user):
            audit.record("vendor.login", actor=user, outcome=AuditOutcome.DENIED,
                         reason="no valid vendor grant", target_type="auth.user", target_id=str(user.pk),
                         target_label=user.get_username())
            raise ValidationError("Your vendor access has ended or is not approved yet.", code="vendor_expired")


class LoginView(auth_views.LoginView):
    template_name = "registration/login.html"
    redirect_authenticated_user = True
    authentication_form = AtriumAuthenticationForm

    def get_context_data(self, **kwargs):
        ctx = super().get_context_data(**kwargs)
        ctx["oidc_enabled"] = settings.OIDC_ENABLED
        return ctx


@login_required
def ping(request):
    """The trivial signed-in page benchmarks compare against (BENCHMARKS.md section 3): session,
    user, navigation and the base template, no data of its own."""
    from tenants import access

    access.prime(request.user)  # as the dashboard does: the navigation's permission questions in two queries
    return render(request, "portal/ping.html")


@login_required
def home(request):
    from portal.dashboard_views import dashboard_page

    return dashboard_page(request)


@login_required
@require_http_methods(["GET", "POST"])
def reauthenticate(request):
    """Sudo mode: confirm the password (or a fresh SSO login) before a sensitive change."""
    next_url = request.POST.get("next") or request.GET.get("next") or "/"
    if not url_has_allowed_host_and_scheme(next_url, {request.get_host()}, request.is_secure()):
        next_url = "/"
    if request.method == "POST":
        user = authenticate(request, username=request.user.get_username(), password=request.POST.get("password", ""))
        if user is not None and user.pk == request.user.pk:
            request.session[SUDO_SESSION_KEY] = time.time()
            audit.record("auth.reauthenticate", actor=request.user, target_type="auth.user",
                         target_id=str(request.user.pk), target_label=request.user.get_username())
            messages.success(request, "Identity confirmed for the next few minutes.")
            return HttpResponseRedirect(next_url)
        if not getattr(request, lockout.REFUSED_ATTR, False):  # a lockout refusal: portal.lockout answers
            audit.record("auth.reauthenticate", actor=request.user, outcome=AuditOutcome.DENIED,
                         reason="wrong password", target_type="auth.user", target_id=str(request.user.pk))
            messages.error(request, "That password is not right.")
    sso = request.session.get("_auth_user_backend", "").endswith("AtriumOIDCBackend")
    return render(request, "portal/reauthenticate.html", {"next": next_url, "sso": sso and settings.OIDC_ENABLED})


def error_403(request, exception=None):
    return render(request, "403.html", {"reason": str(exception or "")}, status=403)


def error_404(request, exception=None):
    return render(request, "404.html", status=404)


def error_500(request):
    return render(request, "500.html", status=500)
