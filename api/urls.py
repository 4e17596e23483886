"""URLs of the api app, included at /api/: the token page and version 1 of the JSON API.

No app namespace: django-ninja reverses its own routes as "api-v1:<name>" from the root.

Anything else under /api/v1/ answers a problem+json 404 (not the portal's HTML 404), so a
client that mistypes a path gets an error it can parse.
"""

from django.urls import path, re_path

from api import views
from api.problems import problem_response
from api.v1 import api as v1


def unknown_endpoint(request, rest=""):
    return problem_response(request, "not-found", "There is no such API endpoint; see /api/v1/docs.")


urlpatterns = [
    path("tokens/", views.token_list, name="api_token_list"),
    path("tokens/<int:pk>/revoke/", views.token_revoke, name="api_token_revoke"),
    path("v1/", v1.urls),
    re_path(r"^v1/(?P<rest>.*)$", unknown_endpoint, name="api_unknown_endpoint"),
]
