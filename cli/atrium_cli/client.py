"""A small HTTP client of the Atrium API: JSON in, JSON out, problems turned into ApiError."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

from atrium_cli import __version__


class ApiError(Exception):
    """The server answered a problem document (or could not be reached: status 0)."""

    def __init__(self, status: int, type_: str, detail: str, errors=None, retry_after=None):
        super().__init__(detail)
        self.status, self.type, self.detail, self.errors, self.retry_after = status, type_, detail, errors or [], retry_after

    @property
    def slug(self) -> str:
        return self.type.rsplit(":", 1)[-1]


class Client:
    def __init__(self, url: str, token: str | None, timeout: float = 30):
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ApiError(0, "bad-url", f"{url!r} is not an http(s) URL of an Atrium portal")
        self.base = url.rstrip("/") + "/api/v1"
        self.token = token
        self.timeout = timeout

    def request(self, method: str, path: str, *, params: dict | None = None, body=None, raw: bool = False):
        url = self.base + path
        if params:
            clean = {k: v for k, v in params.items() if v not in (None, "", False)}
            if clean:
                url += "?" + urllib.parse.urlencode(clean, doseq=True)
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method)  # noqa: S310 (http(s) checked in __init__)
        req.add_header("Accept", "application/json, application/problem+json")
        req.add_header("User-Agent", f"atrium-cli/{__version__}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # noqa: S310 # nosec B310 # http(s) checked in __init__
                content = resp.read()
                if raw:
                    return content
                return json.loads(content) if content else None
        except urllib.error.HTTPError as exc:
            content = exc.read()
            try:
                doc = json.loads(content)
            except ValueError:
                doc = {}
            if not isinstance(doc, dict):
                doc = {}
            retry = exc.headers.get("Retry-After")
            raise ApiError(exc.code, doc.get("type", f"http-{exc.code}"),
                           doc.get("detail") or f"the server answered HTTP {exc.code} {exc.reason}",
                           doc.get("errors"), int(retry) if retry and retry.isdigit() else None) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ApiError(0, "unreachable", f"cannot reach {self.base} ({reason})") from None

    def get(self, path, **params):
        return self.request("GET", path, params=params)

    def post(self, path, body=None):
        return self.request("POST", path, body=body if body is not None else {})

    def download(self, path, **params) -> bytes:
        return self.request("GET", path, params=params, raw=True)

    def delete(self, path):
        return self.request("DELETE", path)
