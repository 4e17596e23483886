"""Reading NVIDIA DCGM exporter metrics: Prometheus text format in, per-card health signals out.

The Kubernetes backend scrapes the exporter's `/metrics` endpoint(s) (setting
ATRIUM_DCGM_EXPORTER_URLS) and turns the samples into `CardSignal`s keyed by card UUID; the
health policy itself stays in scheduling.services.record_health_event. This module only parses
and fetches: it must never change a database row, and a malformed line is skipped, never fatal.
"""

from __future__ import annotations

import math
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from scheduling.models import HealthEventKind

XID = "DCGM_FI_DEV_XID_ERRORS"
ECC_DBE = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
ROW_REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
HEALTH_STATUS = "DCGM_EXP_GPU_HEALTH_STATUS"

# DCGM health watch results (dcgmHealthWatchResult_t): PASS 0, WARN 10, FAIL 20.
HEALTH_WARN, HEALTH_FAIL = 10, 20

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict
    value: float


def parse_text(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition (version 0.0.4); comments and bad lines skipped."""
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = {}
        body = m.group("labels") or ""
        pos = 0
        ok = True
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            if not lm:
                ok = False
                break
            labels[lm.group(1)] = re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], lm.group(2))
            pos = lm.end()
        if not ok:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        out.append(Sample(m.group("name"), labels, value))
    return out


@dataclass
class CardReading:
    """What the exporter says about one card (by UUID) in one scrape."""

    uuid: str
    hostname: str = ""
    index: int | None = None
    model_name: str = ""
    values: dict = field(default_factory=dict)
    pod: str = ""
    namespace: str = ""


def readings(samples: list[Sample]) -> dict[str, CardReading]:
    """Group samples by card UUID; the exporter labels every per-GPU sample with UUID and gpu."""
    cards: dict[str, CardReading] = {}
    for s in samples:
        uuid = s.labels.get("UUID")
        if not uuid or not s.name.startswith("DCGM_"):
            continue
        card = cards.setdefault(uuid, CardReading(uuid=uuid))
        card.hostname = card.hostname or s.labels.get("Hostname", "")
        if card.index is None and s.labels.get("gpu", "").isdigit():
            card.index = int(s.labels["gpu"])
        card.model_name = card.model_name or s.labels.get("modelName", "")
        card.pod = card.pod or s.labels.get("pod", "")
        card.namespace = card.namespace or s.labels.get("namespace", "")
        if not math.isnan(s.value):
            card.values[s.name] = s.value
    return cards


@dataclass(frozen=True)
class CardSignal:
    """One metric family's state for one card, as the health policy takes it.

    `family` and `key` let the backend report a gauge that keeps its value once, not on every
    scrape: the key is written into the HealthEvent message ("dcgm[xid:79] ...") and a reading
    whose key equals the family's last recorded key is not reported again. A `cleared` signal
    (the metric back at zero) is reported once with a policy-neutral kind, so the same fault
    coming back later is seen as new.
    """

    uuid: str
    family: str
    kind: str
    code: int | None
    message: str
    cleared: bool = False

    @property
    def key(self) -> str:
        return f"{self.family}:{0 if self.cleared else (self.code if self.code is not None else 1)}"

    @property
    def tagged_message(self) -> str:
        return f"dcgm[{self.key}] {self.message}"[:300]


def _cleared(uuid: str, family: str, what: str) -> CardSignal:
    # XID without a code is neutral in scheduling.services.health_policy: it never changes health.
    return CardSignal(uuid, family, HealthEventKind.XID, None, f"{what} back to zero on {uuid}", cleared=True)


def signals(card: CardReading) -> list[CardSignal]:
    """The state of each health metric family the card's reading carries (absent ones: nothing)."""
    out = []
    v = card.values
    if XID in v:
        xid = int(v[XID])
        out.append(CardSignal(card.uuid, "xid", HealthEventKind.XID, xid, f"XID {xid} on {card.uuid}") if xid
                   else _cleared(card.uuid, "xid", "XID"))
    if ECC_DBE in v:
        dbe = int(v[ECC_DBE])
        out.append(CardSignal(card.uuid, "ecc_dbe", HealthEventKind.ECC_DBE, dbe,
                              f"{dbe} volatile double-bit ECC error(s) on {card.uuid}") if dbe
                   else _cleared(card.uuid, "ecc_dbe", "double-bit ECC count"))
    if ROW_REMAP_FAILURE in v:
        out.append(CardSignal(card.uuid, "row_remap", HealthEventKind.ROW_REMAP, None,
                              f"row remapping failed on {card.uuid}") if int(v[ROW_REMAP_FAILURE])
                   else _cleared(card.uuid, "row_remap", "row-remap failure"))
    if HEALTH_STATUS in v:
        status = int(v[HEALTH_STATUS])
        # A failed health watch takes the card out of service like an uncorrectable memory
        # error (there is no HealthEventKind of its own yet); a warning only degrades it.
        if status >= HEALTH_FAIL:
            out.append(CardSignal(card.uuid, "health", HealthEventKind.ECC_DBE, status,
                                  f"health watch FAIL ({HEALTH_STATUS}={status}) on {card.uuid}"))
        elif status >= HEALTH_WARN:
            out.append(CardSignal(card.uuid, "health", HealthEventKind.THERMAL, status,
                                  f"health watch WARN ({HEALTH_STATUS}={status}) on {card.uuid}"))
        else:
            out.append(_cleared(card.uuid, "health", "health watch"))
    return out


class ExporterError(Exception):
    pass


def fetch(url: str, timeout: float) -> str:
    """The exporter's text; raises ExporterError with a sentence when it cannot be read."""
    # urlopen would also read file:// and ftp:// URLs: a mistyped setting must not read local files
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise ExporterError(f"the DCGM exporter URL {url!r} is not an http(s) URL")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 # nosec B310 # http(s) checked above
            if resp.status != 200:
                raise ExporterError(f"the DCGM exporter at {url} answered HTTP {resp.status}")
            return resp.read().decode("utf-8", "replace")
    except ExporterError:
        raise
    except Exception as exc:  # URLError, timeouts, connection resets: all mean "not readable now"
        raise ExporterError(f"the DCGM exporter at {url} could not be read: {exc}") from exc


def scrape(urls: list[str], timeout: float) -> tuple[dict[str, CardReading], list[str]]:
    """Readings from every exporter URL, and one sentence per URL that failed."""
    cards: dict[str, CardReading] = {}
    errors = []
    for url in urls:
        try:
            cards.update(readings(parse_text(fetch(url, timeout))))
        except ExporterError as exc:
            errors.append(str(exc))
    return cards, errors
