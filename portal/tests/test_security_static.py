"""Static security checks in `make test`: bandit and the project's own semgrep rules.

bandit (config: [tool.bandit] in pyproject.toml) and semgrep (rules: .semgrep/atrium.yml,
offline: --metrics=off, local --config only, run without a network where the machine allows)
must report nothing on the project. A finding is fixed in the code, or the line carries a
suppression that names its check and says why (`# nosec B105 # why`,
`# nosemgrep: <rule-id> -- why`); a test refuses any other kind.

Each semgrep rule must be able to fail: it is run on planted violations and clean twins
under portal/tests/fixtures/semgrep/ (left out of the main scan by .semgrepignore), and
every line annotated `ruleid: <rule>` must be reported, no `ok: <rule>` line may be.
The three scans start together in one module fixture, so on two cores they overlap.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / ".semgrep"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "semgrep"
BIN = Path(sys.executable).parent
TIMEOUT = 600
RULE_IDS = [rule["id"] for path in sorted(RULES.glob("*.yml")) for rule in yaml.safe_load(path.read_text())["rules"]]
# "ruleid: x" / "ok: x" in a comment, applying to the next line that is not itself an annotation
ANNOTATION = re.compile(r"\b(ruleid|ok):\s*([\w-]+)")

pytestmark = pytest.mark.slow


@cache
def _offline() -> list[str]:
    """`unshare -n` (a network namespace with nothing in it) where this machine allows it, so
    the scan proves it needs no network; plain otherwise (the flags below still keep it local)."""
    try:
        ok = subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return ["unshare", "-n"] if ok else []


def _tool(name: str) -> str:
    path = BIN / name
    assert path.exists(), f"{name} is not installed in {BIN}: run `pip install -r requirements-dev.txt` (make test does)"
    return str(path)


def _semgrep(*targets: str) -> subprocess.Popen:
    env = {**os.environ, "SEMGREP_ENABLE_VERSION_CHECK": "0", "SEMGREP_SEND_METRICS": "off"}
    cmd = [*_offline(), _tool("semgrep"), "scan", "--config", str(RULES), "--metrics=off", "--disable-version-check",
           "--json", "--quiet", "--timeout", "60", *targets]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _bandit(*targets: str) -> subprocess.Popen:
    cmd = [_tool("bandit"), "-c", "pyproject.toml", "-f", "json", "-q", *targets]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _json(proc: subprocess.Popen, ok_codes=(0,)) -> dict:
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode in ok_codes, f"{' '.join(map(str, proc.args))} exited {proc.returncode}:\n{err[-3000:]}"
    return json.loads(out)


def _fixture_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in FIXTURES.rglob("*") if p.is_file() and p.name != "README.md")


@pytest.fixture(scope="module")
def scans():
    """The three scans, started at once; each test waits only for the one it reads."""
    procs = {
        "semgrep": _semgrep("."),
        "semgrep_fixtures": _semgrep(*_fixture_files()),
        "bandit": _bandit("-r", "."),
    }
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _where(result: dict) -> str:
    line = result.get("start", {}).get("line") or result.get("line_number")
    return f"{result.get('path') or result.get('filename')}:{line}"


# --- semgrep -------------------------------------------------------------------------------


def test_semgrep_finds_nothing_in_the_project(scans):
    report = _json(scans["semgrep"])
    assert not report["errors"], f"semgrep could not check everything: {report['errors']}"
    found = [f"{_where(r)} {r['check_id'].rsplit('.', 1)[-1]}: {r['extra']['message'][:160]}" for r in report["results"]]
    assert not found, "semgrep findings (fix the code, or allow-list the line with a reason):\n" + "\n".join(found)
    scanned = set(report["paths"]["scanned"])
    # it really looked at the modules the rules are about, and not at the planted violations
    for must in ("serving/gateway.py", "api/v1.py", "tenants/views.py", "templates/base.html", "tenants/access.py"):
        assert must in scanned, f"{must} was not scanned: check .semgrepignore"
    assert len(scanned) > 150, f"only {len(scanned)} files scanned"
    assert not [p for p in scanned if p.startswith(("portal/tests/", ".venv/", "var/"))]


def _annotations() -> dict[str, dict[str, set[tuple[str, int]]]]:
    """rule -> {"ruleid": {(path, line)}, "ok": {(path, line)}} from the fixture files."""
    out: dict[str, dict[str, set[tuple[str, int]]]] = {}
    for rel in _fixture_files():
        pending: list[tuple[str, str]] = []
        for number, line in enumerate((ROOT / rel).read_text().splitlines(), start=1):
            marks = ANNOTATION.findall(line)
            if marks and line.strip().startswith(("#", "{#", "<!--")):
                pending.extend(marks)
                continue
            for kind, rule in pending:
                out.setdefault(rule, {"ruleid": set(), "ok": set()})[kind].add((rel, number))
            pending = []
    return out


@pytest.mark.parametrize("rule", RULE_IDS)
def test_each_semgrep_rule_fires_on_its_planted_violation_and_not_on_its_clean_case(rule, scans):
    report = _json(scans["semgrep_fixtures"])
    assert not report["errors"], report["errors"]
    expected = _annotations().get(rule)
    assert expected and expected["ruleid"] and expected["ok"], (
        f"{rule}: plant at least one violation (`ruleid: {rule}`) and one clean case (`ok: {rule}`) in {FIXTURES}")
    got = {(r["path"], r["start"]["line"]) for r in report["results"] if r["check_id"].rsplit(".", 1)[-1] == rule}
    missed = sorted(expected["ruleid"] - got)
    assert not missed, f"{rule} did not fire on its planted violations: {missed}"
    wrong = sorted(expected["ok"] & got)
    assert not wrong, f"{rule} fired on clean code: {wrong}"


def test_semgrep_reports_nothing_unplanned_in_the_fixtures(scans):
    report = _json(scans["semgrep_fixtures"])
    planted = _annotations()
    unplanned = [f"{_where(r)} {r['check_id']}" for r in report["results"]
                 if (r["path"], r["start"]["line"]) not in planted.get(r["check_id"].rsplit(".", 1)[-1], {}).get("ruleid", ())]
    assert not unplanned, "findings on fixture lines without a `ruleid:` annotation:\n" + "\n".join(unplanned)
    assert set(planted) <= set(RULE_IDS), f"annotations name rules that do not exist: {sorted(set(planted) - set(RULE_IDS))}"


# --- bandit --------------------------------------------------------------------------------


def test_bandit_has_no_unexplained_finding(scans):
    report = _json(scans["bandit"], ok_codes=(0, 1))
    assert not report["errors"], f"bandit could not read: {report['errors']}"
    found = [f"{r['filename']}:{r['line_number']} {r['test_id']} {r['issue_text']}" for r in report["results"]]
    assert not found, "bandit findings (fix the code, or `# nosec BXXX # why` on the line):\n" + "\n".join(found)
    files = [name for name in report["metrics"] if name != "_totals"]
    assert report["metrics"]["_totals"]["loc"] > 10_000 and len(files) > 100, "bandit scanned too little: check exclude_dirs"
    assert not [f for f in files if "/tests/" in f or "/.venv/" in f]


def test_bandit_configuration_still_catches_a_planted_violation(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import hashlib\nimport subprocess\n\nimport yaml\n\n\n"
        "def run(cmd, text, password):\n"
        "    subprocess.call(cmd, shell=True)\n"
        "    hashlib.md5(password.encode())\n"
        "    return yaml.load(text)\n"
    )
    report = _json(_bandit(str(planted)), ok_codes=(0, 1))
    missing = {"B602", "B324", "B506"} - {r["test_id"] for r in report["results"]}
    assert not missing, f"bandit with our configuration no longer reports {sorted(missing)}"


# --- suppressions --------------------------------------------------------------------------

NOSEC = re.compile(r"#\s*nosec\b(?P<rest>.*)")
NOSEC_OK = re.compile(r"^\s*(B\d{3})(\s*,\s*B\d{3})*\s*#\s*\S.{5,}")
NOSEMGREP = re.compile(r"nosemgrep\b(?P<rest>.*)")
NOSEMGREP_OK = re.compile(r"^:\s*(?P<ids>[\w-]+(\s*,\s*[\w-]+)*)\s+--\s+\S.{5,}")
SKIP_DIRS = {".git", ".venv", "node_modules", "var", "fixtures", "__pycache__"}


def _project_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if name.endswith((".py", ".html", ".txt")):
                path = Path(dirpath) / name
                if path != Path(__file__).resolve():
                    yield path


def test_every_suppression_names_a_rule_and_a_reason():
    problems, counted = [], {"nosec": 0, "nosemgrep": 0}
    for path in _project_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            where = f"{path.relative_to(ROOT)}:{number}"
            if m := NOSEC.search(line):
                counted["nosec"] += 1
                if not NOSEC_OK.match(m["rest"]):
                    problems.append(f"{where}: write `# nosec BXXX # <why>` (the check's id, then the reason)")
            if m := NOSEMGREP.search(line):
                counted["nosemgrep"] += 1
                ok = NOSEMGREP_OK.match(m["rest"])
                if not ok:
                    problems.append(f"{where}: write `# nosemgrep: <rule-id> -- <why>`")
                elif unknown := {i.strip() for i in ok["ids"].split(",")} - set(RULE_IDS):
                    problems.append(f"{where}: no such semgrep rule {sorted(unknown)}")
    assert not problems, "\n".join(problems)
    assert counted["nosec"] and counted["nosemgrep"], "the walk found no suppression at all: is it looking at the project?"
