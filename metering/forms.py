"""Forms of the metering pages: report request, budget, prices. Choices of scope come from the
user's reach (metering.services.report_scopes / tenants.access), never from every row."""

from __future__ import annotations

import datetime as dt

from django import forms
from django.utils import timezone

from metering.models import BudgetMode, BudgetUnit, ReportGrouping, ReportMode
from scheduling.models import AcceleratorModel


def _last_month() -> tuple[dt.date, dt.date]:
    first = timezone.now().date().replace(day=1)
    return (first - dt.timedelta(days=1)).replace(day=1), first


class ReportForm(forms.Form):
    scope = forms.ChoiceField(help_text="what the report covers; your role decides what you may choose")
    period_start = forms.DateField(widget=forms.DateInput(attrs={"type": "date"}))
    period_end = forms.DateField(widget=forms.DateInput(attrs={"type": "date"}), help_text="exclusive")
    grouping = forms.ChoiceField(choices=ReportGrouping.choices, initial=ReportGrouping.TENANT)
    mode = forms.ChoiceField(choices=ReportMode.choices, initial=ReportMode.SHOWBACK)

    def __init__(self, *args, scopes: dict, **kwargs):
        super().__init__(*args, **kwargs)
        choices = [("all", "every tenant")] if scopes["all"] else []
        choices += [(f"t{t.pk}", f"tenant {t.slug}") for t in scopes["tenants"]]
        choices += [(f"p{p.pk}", f"project {p.tenant.slug}/{p.slug}") for p in scopes["projects"]]
        self.fields["scope"].choices = choices
        self.scopes = scopes
        start, end = _last_month()
        self.fields["period_start"].initial, self.fields["period_end"].initial = start, end

    def clean(self):
        data = super().clean()
        if data.get("period_start") and data.get("period_end") and data["period_end"] <= data["period_start"]:
            self.add_error("period_end", "The period must end after it starts.")
        if data.get("period_start") and data.get("period_end") and (data["period_end"] - data["period_start"]).days > 366:
            self.add_error("period_end", "A report covers at most one year.")
        return data

    def scope_objects(self) -> dict:
        value = self.cleaned_data["scope"]
        if value.startswith("t"):
            return {"tenant": self.scopes["tenants"].get(pk=int(value[1:]))}
        if value.startswith("p"):
            return {"project": self.scopes["projects"].get(pk=int(value[1:]))}
        return {}


class BudgetForm(forms.Form):
    scope = forms.ChoiceField()
    unit = forms.ChoiceField(choices=BudgetUnit.choices)
    amount = forms.DecimalField(min_value=0.01, max_digits=14, decimal_places=2)
    mode = forms.ChoiceField(choices=BudgetMode.choices, widget=forms.RadioSelect, initial=BudgetMode.WARN)
    thresholds = forms.CharField(initial="80, 100", help_text="percentages, separated by commas")

    def __init__(self, *args, tenants, projects, **kwargs):
        super().__init__(*args, **kwargs)
        self.tenants, self.projects = tenants, projects
        self.fields["scope"].choices = (
            [(f"t{t.pk}", f"tenant {t.slug}") for t in tenants]
            + [(f"p{p.pk}", f"project {p.tenant.slug}/{p.slug}") for p in projects]
        )

    def clean_thresholds(self) -> list[int]:
        try:
            values = sorted({int(v) for v in self.cleaned_data["thresholds"].replace(" ", "").split(",") if v})
        except ValueError:
            raise forms.ValidationError("Write whole percentages separated by commas, e.g. 80, 100.") from None
        if not values or any(v < 1 or v > 1000 for v in values):
            raise forms.ValidationError("Each threshold is a percentage between 1 and 1000.")
        return values

    def scope_objects(self) -> dict:
        value = self.cleaned_data["scope"]
        if value.startswith("p"):
            project = self.projects.get(pk=int(value[1:]))
            return {"tenant": project.tenant, "project": project}
        return {"tenant": self.tenants.get(pk=int(value[1:]))}


class PriceForm(forms.Form):
    accelerator_model = forms.ModelChoiceField(queryset=AcceleratorModel.objects.order_by("name"))
    per_card_hour = forms.DecimalField(min_value=0, max_digits=10, decimal_places=4)
    effective_from = forms.DateTimeField(
        required=False, widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
        help_text="empty: from now on. A price never starts before usage already accrued.",
    )
