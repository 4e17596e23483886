"""URLs of the serving pages, mounted at /serving/ (the gateway lives at /v1/, see gateway_urls)."""

from django.urls import path

from serving import views

app_name = "serving"

urlpatterns = [
    path("", views.service_list, name="service_list"),
    path("services/new/", views.service_create, name="service_create"),
    path("services/<int:pk>/", views.service_detail, name="service_detail"),
    path("services/<int:pk>/publish/", views.service_publish, name="service_publish"),
    path("services/<int:pk>/retire/", views.service_retire, name="service_retire"),
    path("applications/", views.application_list, name="application_list"),
    path("applications/new/", views.application_create, name="application_create"),
    path("kbs/", views.kb_list, name="kb_list"),
    path("kbs/new/", views.kb_create, name="kb_create"),
    path("kbs/<int:pk>/", views.kb_detail, name="kb_detail"),
    path("kbs/<int:pk>/upload/", views.kb_upload, name="kb_upload"),
    path("keys/", views.key_list, name="key_list"),
    path("keys/new/", views.key_create, name="key_create"),
    path("keys/<int:pk>/", views.key_detail, name="key_detail"),
    path("keys/<int:pk>/rotate/", views.key_rotate, name="key_rotate"),
    path("keys/<int:pk>/revoke/", views.key_revoke, name="key_revoke"),
]
