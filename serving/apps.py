from django.apps import AppConfig


class ServingConfig(AppConfig):
    name = "serving"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from serving import authcache

        authcache.connect_signals()  # a change to what a key check reads invalidates the cached ones
