from django.urls import path

from scheduling import views

app_name = "scheduling"

urlpatterns = [
    path("jobs/", views.job_list, name="job_list"),
    path("jobs/new/", views.job_create, name="job_create"),
    path("jobs/<int:pk>/", views.job_detail, name="job_detail"),
    path("jobs/<int:pk>/cancel/", views.job_cancel, name="job_cancel"),
    path("nodes/", views.node_list, name="node_list"),
    path("nodes/<int:pk>/", views.node_detail, name="node_detail"),
    path("cards/<int:pk>/health/", views.card_health, name="card_health"),
]
