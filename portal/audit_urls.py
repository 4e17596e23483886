from django.urls import path

from portal import audit_views

app_name = "portal"

urlpatterns = [
    path("", audit_views.audit_list, name="audit_list"),
]
