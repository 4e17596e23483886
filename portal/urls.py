"""Atrium's URL map: each app's URLs under its own prefix, health probes at the root."""

from django.contrib.auth import views as auth_views
from django.urls import include, path

from portal import views
from tenants.urls import platform_urlpatterns

urlpatterns = [
    path("", views.home, name="home"),
    path("healthz", views.healthz, name="healthz"),
    path("ping", views.ping, name="ping"),  # trivial signed-in page: the benchmarks' baseline
    path("readyz", views.readyz, name="readyz"),
    path("login/", views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("reauthenticate/", views.reauthenticate, name="reauthenticate"),
    path("audit/", include("portal.audit_urls")),
    path("scheduling/", include("scheduling.urls")),
    path("metering/", include("metering.urls")),
    path("tenants/", include("tenants.urls")),
    path("platform/", include((platform_urlpatterns, "platform"))),
    path("api/", include("api.urls")),
    path("serving/", include("serving.urls")),
    path("v1/", include("serving.gateway_urls")),
]
# Always routed, so tests can switch SSO on with override_settings (the URLconf is loaded
# once); the views answer 404 unless settings.OIDC_ENABLED, and the login page shows the
# SSO button only then.
urlpatterns.append(path("oidc/", include("mozilla_django_oidc.urls")))

handler403 = "portal.views.error_403"
handler404 = "portal.views.error_404"
handler500 = "portal.views.error_500"
