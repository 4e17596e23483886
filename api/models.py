"""Personal access tokens: how a script or the `atrium` CLI acts as a person over the API.

A token row holds only an HMAC-SHA256 of the secret (keyed by a server-side key), a short
public prefix to recognise it in lists, its scope, its expiry and its revocation. The secret
itself is shown once at creation and never stored. Rows change only through api.tokens
(which audits); they are never deleted, so the audit trail always names an existing token.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class TokenScope(models.TextChoices):
    # ordered: each scope includes the ones before it
    READ = "read", "read: list and look"
    SUBMIT = "submit", "submit: read, submit and cancel jobs"
    ADMIN = "admin", "admin: submit, manage tokens and quota splits"


SCOPE_ORDER = [TokenScope.READ, TokenScope.SUBMIT, TokenScope.ADMIN]


class PersonalAccessToken(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=80, help_text='what it is for, e.g. "laptop CLI"')
    prefix = models.CharField(max_length=12, db_index=True, help_text="the public start of the token, to recognise it")
    digest = models.CharField(max_length=64, unique=True, help_text="HMAC-SHA256 of the whole token")
    scope = models.CharField(max_length=8, choices=TokenScope.choices, default=TokenScope.READ)
    created = models.DateTimeField(default=timezone.now)
    expires = models.DateTimeField()
    last_used = models.DateTimeField(null=True, blank=True)
    revoked = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created"]
        default_permissions = ()
        indexes = [models.Index(fields=["user", "-created"])]

    def __str__(self) -> str:
        return f"token {self.prefix}… ({self.name})"

    @property
    def is_expired(self) -> bool:
        return self.expires <= timezone.now()

    @property
    def is_valid(self) -> bool:
        return self.revoked is None and not self.is_expired

    def allows(self, scope: str) -> bool:
        return SCOPE_ORDER.index(TokenScope(self.scope)) >= SCOPE_ORDER.index(TokenScope(scope))
