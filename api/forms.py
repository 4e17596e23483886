"""The token page's form: name, scope and lifetime of a new personal access token."""

from django import forms

from api.models import TokenScope
from api.tokens import MAX_DAYS


class TokenForm(forms.Form):
    name = forms.CharField(max_length=80, help_text='Where it is used, e.g. "laptop CLI".')
    scope = forms.ChoiceField(choices=TokenScope.choices, initial=TokenScope.READ)
    expires_in_days = forms.IntegerField(min_value=1, max_value=MAX_DAYS, initial=30, label="Expires in (days)")
