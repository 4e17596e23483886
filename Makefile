# Atrium: two commands. `make run` starts a working portal with the demo organisation;
# `make test` runs ruff and the whole test suite against PostgreSQL and Redis.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

# make test uses this PostgreSQL server; pytest-django creates and drops test_atrium on it.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/atrium
TEST_REDIS_URL ?= redis://127.0.0.1:6379/15

.PHONY: run test lint bench seed clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(STAMP): requirements.txt pyproject.toml | $(PY)
	$(PIP) install --quiet -r requirements.txt
	$(PIP) install --quiet --no-deps -e .
	touch $@

$(DEV_STAMP): requirements.txt requirements-dev.txt pyproject.toml | $(PY)
	$(PIP) install --quiet -r requirements-dev.txt
	$(PIP) install --quiet --no-deps -e .
	touch $(STAMP) $@

run: $(STAMP)
	@DEBUG=$${DEBUG:-1} $(PY) manage.py check_redis
	DEBUG=$${DEBUG:-1} $(PY) manage.py migrate --no-input -v0
	DEBUG=$${DEBUG:-1} $(PY) manage.py seed_demo
	DEBUG=$${DEBUG:-1} $(PY) manage.py run_all

test: $(DEV_STAMP)
	$(VENV)/bin/ruff check .
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) SECRET_KEY=test-only-secret-key-0123456789abcdef-not-for-production \
	DEBUG=0 ATRIUM_TESTING=1 SECURE_SSL_REDIRECT=0 SESSION_COOKIE_SECURE=0 CSRF_COOKIE_SECURE=0 SECURE_HSTS_SECONDS=0 \
	$(PY) -m pytest $(PYTEST_ARGS)

# Longer fuzzing, outside make test: schemathesis with many more examples per API operation
# (randomized), and the form, gateway and upload fuzz tests under the "fuzz" hypothesis profile
# (conftest.py) with FUZZ_EXAMPLES examples each. About 10 minutes with the defaults on a busy
# two-core machine (the forms take most of it: every form gets FUZZ_EXAMPLES bodies).
FUZZ_EXAMPLES ?= 100
FUZZ_SCHEMATHESIS_EXAMPLES ?= 200
FUZZ_SCHEMATHESIS_BUDGET ?= 240
FUZZ_TESTS := api/tests/test_schemathesis.py portal/tests/test_fuzz_forms.py serving/tests/test_gateway_fuzz.py \
	serving/tests/test_upload_fuzz.py::test_any_bytes_under_any_name_are_indexed_or_refused_with_a_reason \
	serving/tests/test_upload_fuzz.py::test_chunks_without_overlap_are_the_words_in_order_within_their_bounds \
	serving/tests/test_upload_fuzz.py::test_chunks_overlap_by_at_most_their_overlap_and_lose_no_word \
	serving/tests/test_upload_fuzz.py::test_the_text_of_a_generated_pdf_comes_back_word_for_word \
	serving/tests/test_upload_fuzz.py::test_a_damaged_pdf_is_read_or_refused_never_a_crash

.PHONY: fuzz
fuzz: $(DEV_STAMP)
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) SECRET_KEY=test-only-secret-key-0123456789abcdef-not-for-production \
	DEBUG=0 ATRIUM_TESTING=1 SECURE_SSL_REDIRECT=0 SESSION_COOKIE_SECURE=0 CSRF_COOKIE_SECURE=0 SECURE_HSTS_SECONDS=0 \
	ATRIUM_HYPOTHESIS_PROFILE=fuzz ATRIUM_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) \
	ATRIUM_SCHEMATHESIS_EXAMPLES=$(FUZZ_SCHEMATHESIS_EXAMPLES) ATRIUM_SCHEMATHESIS_BUDGET=$(FUZZ_SCHEMATHESIS_BUDGET) \
	ATRIUM_SCHEMATHESIS_OVERRUN=120 \
	$(PY) -m pytest -p no:cacheprovider $(FUZZ_TESTS) $(PYTEST_ARGS)

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check .

bench: $(DEV_STAMP)
	$(PY) bench/trace_replay.py --policy fgd,best-fit,random
	$(PY) bench/cycle.py

clean:
	rm -rf var/ .pytest_cache .ruff_cache
