from django.urls import path

from metering import views

app_name = "metering"

urlpatterns = [
    path("usage/", views.usage, name="usage"),
    path("reports/", views.report_list, name="report_list"),
    path("reports/<int:pk>/", views.report_detail, name="report_detail"),
    path("reports/<int:pk>/<str:fmt>/", views.report_download, name="report_download"),
    path("budgets/", views.budget_list, name="budget_list"),
    path("budgets/new/", views.budget_edit, name="budget_create"),
    path("budgets/<int:pk>/", views.budget_edit, name="budget_edit"),
    path("prices/", views.price_list, name="price_list"),
]
