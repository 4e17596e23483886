"""Atrium settings, read from the environment (django-environ).

Every value an operator may change comes from an environment variable documented in
docs/configuration.md. Development defaults exist only where they are harmless; a production
start (DEBUG=0) without SECRET_KEY, or with a DATABASE_URL that cannot be parsed, stops with
one sentence (manage.py and the WSGI entry catch ImproperlyConfigured).
"""

from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import environ
from csp.constants import NONE, SELF
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"

env = environ.Env()
if (BASE_DIR / ".env").exists():
    environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

DEBUG = env.bool("DEBUG", default=False)
TESTING = env.bool("ATRIUM_TESTING", default=False)

_DEV_SECRET = "atrium-development-only-secret-key-never-use-in-production-0123456789"  # nosec B105 # DEBUG=1 only (below)
SECRET_KEY = env.str("SECRET_KEY", default="")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY is not set; set it in the environment (DEBUG=0 has no default key)."
        )
    SECRET_KEY = _DEV_SECRET

ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["127.0.0.1", "localhost", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])
# Addresses of reverse proxies whose X-Forwarded-For we believe (audit source address).
ATRIUM_TRUSTED_PROXIES = env.list("ATRIUM_TRUSTED_PROXIES", default=[])


def _database(url: str) -> dict:
    scheme = urlsplit(url).scheme
    if scheme not in {"sqlite", "postgres", "postgresql", "pgsql", "psql"}:
        raise ImproperlyConfigured(
            f"DATABASE_URL {url!r} cannot be used: expected postgres://... or sqlite:///..."
        )
    try:
        cfg = env.db_url_config(url)
    except Exception as exc:  # environ raises several kinds for a malformed URL
        raise ImproperlyConfigured(f"DATABASE_URL {url!r} cannot be parsed ({exc}).") from exc
    if cfg.get("ENGINE", "").endswith("sqlite3"):
        # web, worker and scheduler loop share the file: wait for locks, let readers run
        cfg.setdefault("OPTIONS", {}).update({"timeout": 20, "init_command": "PRAGMA journal_mode=WAL;"})
        if cfg["NAME"] not in ("", ":memory:"):
            Path(cfg["NAME"]).parent.mkdir(parents=True, exist_ok=True)
    if cfg.get("ENGINE", "").endswith("postgresql"):
        cfg.setdefault("OPTIONS", {})
        cfg["CONN_MAX_AGE"] = env.int("DATABASE_CONN_MAX_AGE", default=60)
        cfg["CONN_HEALTH_CHECKS"] = True
        cfg["OPTIONS"].setdefault("connect_timeout", 5)
    return cfg


DATABASES = {"default": _database(env.str("DATABASE_URL", default=f"sqlite:///{VAR_DIR}/atrium.sqlite3"))}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# SQLite (development only) cannot enforce "nulls not distinct" on the quota line; the
# services upsert quota lines, and PostgreSQL enforces the constraint.
SILENCED_SYSTEM_CHECKS = ["models.W047"]

REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")
if urlsplit(REDIS_URL).scheme not in {"redis", "rediss", "unix"}:
    raise ImproperlyConfigured(f"REDIS_URL {REDIS_URL!r} is not a redis:// URL.")

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "guardian",
    "axes",
    "django_htmx",
    "django_rq",
    "django_tables2",
    "django_filters",
    "csp",
    "mozilla_django_oidc",
    "portal",
    "tenants",
    "scheduling",
    "metering",
    "serving",
    "api",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # after SecurityMiddleware, so probes get its headers too; their paths are exempt from the
    # HTTPS redirect (SECURE_REDIRECT_EXEMPT) and no Host check runs before them
    "portal.middleware.HealthProbeMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "portal.middleware.RequestContextMiddleware",
    # a lost database answers 503 + Retry-After, not a 500 (portal/resilience.py)
    "portal.resilience.DatabaseUnavailableMiddleware",
    # /v1/ (API-key gateway) goes straight to its view from here: no session, CSRF, auth, CSP nonce
    "portal.middleware.GatewayShortPathMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "portal.middleware.SessionValidityMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "csp.middleware.CSPMiddleware",
    # last: turns a locked-out sign-in into the page of portal.lockout (inside CSP and headers)
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "portal.urls"
WSGI_APPLICATION = "portal.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "portal.context_processors.atrium",
                "portal.resilience.background_status",
            ],
        },
    }
]

if TESTING:
    # thousands of test logins: a fast hash; never used outside `make test`
    PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

# --- Sign-in: local accounts always (development, break-glass), OIDC when an issuer is set ---
OIDC_OP_DISCOVERY_URL = env.str("OIDC_OP_DISCOVERY_URL", default="")
OIDC_OP_ISSUER = env.str("OIDC_OP_ISSUER", default="")
OIDC_RP_CLIENT_ID = env.str("OIDC_RP_CLIENT_ID", default="atrium")
OIDC_RP_CLIENT_SECRET = env.str("OIDC_RP_CLIENT_SECRET", default="")
OIDC_RP_SIGN_ALGO = "RS256"
OIDC_RP_SCOPES = env.str("OIDC_RP_SCOPES", default="openid email profile groups")
OIDC_USE_PKCE = True
OIDC_PKCE_CODE_CHALLENGE_METHOD = "S256"
OIDC_USE_NONCE = True
OIDC_VERIFY_SSL = env.bool("OIDC_VERIFY_SSL", default=True)
OIDC_TIMEOUT = env.int("OIDC_TIMEOUT", default=10)
OIDC_GROUPS_CLAIM = env.str("OIDC_GROUPS_CLAIM", default="groups")
OIDC_GROUP_PREFIX = env.str("OIDC_GROUP_PREFIX", default="atrium:")
OIDC_RENEW_ID_TOKEN_EXPIRY_SECONDS = env.int("OIDC_RENEW_ID_TOKEN_EXPIRY_SECONDS", default=900)
OIDC_OP_AUTHORIZATION_ENDPOINT = env.str("OIDC_OP_AUTHORIZATION_ENDPOINT", default="")
OIDC_OP_TOKEN_ENDPOINT = env.str("OIDC_OP_TOKEN_ENDPOINT", default="")
OIDC_OP_USER_ENDPOINT = env.str("OIDC_OP_USER_ENDPOINT", default="")
OIDC_OP_JWKS_ENDPOINT = env.str("OIDC_OP_JWKS_ENDPOINT", default="")
OIDC_ENABLED = bool(OIDC_OP_DISCOVERY_URL or OIDC_OP_ISSUER or OIDC_OP_AUTHORIZATION_ENDPOINT)
OIDC_CREATE_USER = True  # the first SSO sign-in creates the account (matched on issuer + subject after)
OIDC_TOKEN_USE_BASIC_AUTH = True  # client_secret_basic, the OpenID Connect default client authentication
OIDC_AUTHENTICATE_CLASS = "portal.oidc.AtriumAuthenticationRequestView"
OIDC_CALLBACK_CLASS = "portal.oidc.AtriumAuthenticationCallbackView"

AUTHENTICATION_BACKENDS = [
    # before ModelBackend: a locked (user name, address) pair is refused before any hashing
    "portal.lockout.LocalLoginThrottle",
    "django.contrib.auth.backends.ModelBackend",
    "guardian.backends.ObjectPermissionBackend",
]
if OIDC_ENABLED:
    AUTHENTICATION_BACKENDS.insert(0, "portal.oidc.AtriumOIDCBackend")
    # re-checks an SSO session with the provider when its ID token expired (htmx-aware)
    MIDDLEWARE.insert(MIDDLEWARE.index("portal.middleware.SessionValidityMiddleware") + 1, "portal.oidc.HtmxSessionRefresh")

# --- Local-account sign-in throttling (django-axes; portal/lockout.py, docs/security.md) ---
# Failures count per (user name, client address) pair, so a guesser cannot lock a person out
# from everywhere; the lockout runs from the failure that caused it and refusals meanwhile do
# not extend it. OIDC callbacks, API tokens and gateway keys never pass through here.
try:
    ATRIUM_LOGIN_FAILURE_LIMIT = env.int("ATRIUM_LOGIN_FAILURE_LIMIT", default=5)
    ATRIUM_LOGIN_LOCKOUT_MINUTES = env.int("ATRIUM_LOGIN_LOCKOUT_MINUTES", default=15)
except ValueError:
    ATRIUM_LOGIN_FAILURE_LIMIT = ATRIUM_LOGIN_LOCKOUT_MINUTES = 0
if ATRIUM_LOGIN_FAILURE_LIMIT < 1 or ATRIUM_LOGIN_LOCKOUT_MINUTES < 1:
    raise ImproperlyConfigured(
        "ATRIUM_LOGIN_FAILURE_LIMIT and ATRIUM_LOGIN_LOCKOUT_MINUTES must both be whole numbers of at least 1."
    )
AXES_FAILURE_LIMIT = ATRIUM_LOGIN_FAILURE_LIMIT
AXES_COOLOFF_TIME = timedelta(minutes=ATRIUM_LOGIN_LOCKOUT_MINUTES)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_CLIENT_IP_CALLABLE = "portal.lockout.client_ip"
AXES_USERNAME_CALLABLE = "portal.lockout.attempted_username"
AXES_WHITELIST_CALLABLE = "portal.lockout.not_a_password_login"
AXES_LOCKOUT_CALLABLE = "portal.lockout.lockout_response"
AXES_DISABLE_ACCESS_LOG = True  # successful sign-ins are in the audit log; no second, unpruned table
AXES_ENABLE_ACCESS_FAILURE_LOG = False

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"
LOGIN_REDIRECT_URL_FAILURE = "login"
# How recent a re-authentication must be for sensitive operations (sudo mode), in seconds.
ATRIUM_SUDO_SECONDS = env.int("ATRIUM_SUDO_SECONDS", default=300)

# guardian: permissions come from per-tenant / per-project role groups; no anonymous user row.
ANONYMOUS_USER_NAME = None
GUARDIAN_RAISE_403 = False
GUARDIAN_RENDER_403 = False

SESSION_ENGINE = "django.contrib.sessions.backends.db"
SESSION_COOKIE_AGE = env.int("SESSION_COOKIE_AGE", default=8 * 3600)
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = env.path("STATIC_ROOT", default=str(VAR_DIR / "static"))
STATICFILES_DIRS = [BASE_DIR / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": (
            "django.contrib.staticfiles.storage.StaticFilesStorage"
            if DEBUG or TESTING
            else "whitenoise.storage.CompressedManifestStaticFilesStorage"
        )
    },
}
MEDIA_ROOT = env.path("MEDIA_ROOT", default=str(VAR_DIR / "media"))
WHITENOISE_USE_FINDERS = DEBUG or TESTING
if DEBUG or TESTING:
    Path(STATIC_ROOT).mkdir(parents=True, exist_ok=True)  # whitenoise warns about a missing root

# the worker schedules the periodic metering work when it starts (metering/worker.py)
RQ = {"WORKER_CLASS": "metering.worker.Worker"}
RQ_QUEUES = {
    name: {"URL": REDIS_URL, "DEFAULT_TIMEOUT": 600}
    for name in ("default", "scheduling", "metering", "reports")
}
ATRIUM_CLUSTER_BACKEND = env.str("ATRIUM_CLUSTER_BACKEND", default="simulated")
if ATRIUM_CLUSTER_BACKEND not in {"simulated", "kubernetes"}:
    raise ImproperlyConfigured(
        f"ATRIUM_CLUSTER_BACKEND={ATRIUM_CLUSTER_BACKEND!r}: choose 'simulated' or 'kubernetes'."
    )
ATRIUM_SCHEDULER_PERIOD = env.int("ATRIUM_SCHEDULER_PERIOD", default=10)
# Cycles start at least this many seconds after the previous one ended (Slurm's
# sched_min_interval): submissions arriving meanwhile are decided together in the next one.
ATRIUM_CYCLE_MIN_INTERVAL = env.float("ATRIUM_CYCLE_MIN_INTERVAL", default=1.0)
# Node-failure recovery: requeued jobs restart only in their own pool, and not on a node that
# was down within the hold time.
ATRIUM_RECOVERY_SAME_POOL = env.bool("ATRIUM_RECOVERY_SAME_POOL", default=True)
ATRIUM_RECOVERY_HOLD_MINUTES = env.int("ATRIUM_RECOVERY_HOLD_MINUTES", default=60)
# Interference on shared cards: a share using more than factor x its share of the card for the
# whole window, while another job shares the card, is alarmed; "requeue" also requeues it.
ATRIUM_INTERFERENCE_POLICY = env.str("ATRIUM_INTERFERENCE_POLICY", default="warn")
if ATRIUM_INTERFERENCE_POLICY not in {"warn", "requeue"}:
    raise ImproperlyConfigured(
        f"ATRIUM_INTERFERENCE_POLICY={ATRIUM_INTERFERENCE_POLICY!r}: choose 'warn' or 'requeue'."
    )
ATRIUM_INTERFERENCE_FACTOR = env.float("ATRIUM_INTERFERENCE_FACTOR", default=1.5)
if ATRIUM_INTERFERENCE_FACTOR < 1:
    raise ImproperlyConfigured("ATRIUM_INTERFERENCE_FACTOR must be at least 1 (1.5 = half again its share).")
ATRIUM_INTERFERENCE_WINDOW_MINUTES = env.int("ATRIUM_INTERFERENCE_WINDOW_MINUTES", default=10)

# --- Kubernetes backend (docs/kubernetes.md) ---
ATRIUM_K8S_KUBECONFIG = env.str("ATRIUM_K8S_KUBECONFIG", default="")
ATRIUM_K8S_CONTEXT = env.str("ATRIUM_K8S_CONTEXT", default="")
ATRIUM_K8S_POOL_LABEL = env.str("ATRIUM_K8S_POOL_LABEL", default="atrium.io/pool")
ATRIUM_K8S_DEFAULT_POOL = env.str("ATRIUM_K8S_DEFAULT_POOL", default="default")
ATRIUM_K8S_PRODUCT_MODELS = env.json("ATRIUM_K8S_PRODUCT_MODELS", default={})
ATRIUM_K8S_SHARED_RESOURCE = env.str("ATRIUM_K8S_SHARED_RESOURCE", default="nvidia.com/gpu.shared")
ATRIUM_K8S_GRACE_SECONDS = env.int("ATRIUM_K8S_GRACE_SECONDS", default=30)
ATRIUM_K8S_TIMEOUT_SECONDS = env.float("ATRIUM_K8S_TIMEOUT_SECONDS", default=10.0)
ATRIUM_K8S_MAX_REQUEUES = env.int("ATRIUM_K8S_MAX_REQUEUES", default=2)
ATRIUM_DCGM_EXPORTER_URLS = env.list("ATRIUM_DCGM_EXPORTER_URLS", default=[])

# --- API (docs/api.md) ---
# Key of the personal access tokens' HMAC; derived from SECRET_KEY when empty.
ATRIUM_API_TOKEN_KEY = env.str("ATRIUM_API_TOKEN_KEY", default="")
ATRIUM_API_RATE_LIMIT = env.str("ATRIUM_API_RATE_LIMIT", default="60/60")
ATRIUM_PLACEMENT_POLICY = env.str("ATRIUM_PLACEMENT_POLICY", default="fgd-cpu")
# Only the concurrency test turns this off, to show that it can catch over-admission.
ATRIUM_CYCLE_LOCK = True
ATRIUM_CURRENCY = env.str("ATRIUM_CURRENCY", default="EUR")
# The gateway's metering writer lets answered requests gather this long between two writes (serving/meterwriter.py).
ATRIUM_METER_GATHER_MS = env.int("ATRIUM_METER_GATHER_MS", default=50)
# The gateway's data plane runs the Django gateway in this many threads per process (serving/dataplane.py).
ATRIUM_GATEWAY_DJANGO_THREADS = env.int("ATRIUM_GATEWAY_DJANGO_THREADS", default=32)

# --- Content Security Policy: no inline script anywhere; plotly needs inline style attributes ---
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF],
        "style-src": [SELF, "'unsafe-inline'"],
        "img-src": [SELF, "data:"],
        "font-src": [SELF, "data:"],
        "connect-src": [SELF],
        "frame-ancestors": [NONE],
        "form-action": [SELF] + ([OIDC_OP_ISSUER] if OIDC_OP_ISSUER else []),
        "base-uri": [SELF],
        "object-src": [NONE],
    }
}

# --- Transport security: on unless DEBUG; health probes stay reachable over plain HTTP ---
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=not DEBUG)
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$"]
SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=0 if DEBUG else 31536000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = not DEBUG
SECURE_HSTS_PRELOAD = not DEBUG
SESSION_COOKIE_SECURE = env.bool("SESSION_COOKIE_SECURE", default=not DEBUG)
CSRF_COOKIE_SECURE = env.bool("CSRF_COOKIE_SECURE", default=not DEBUG)
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    # axes narrates every attempt at INFO; its warnings (a new failure, a lockout) stay
    "loggers": {"django.db.backends": {"level": "INFO"}, "axes": {"level": "WARNING"}},
}
