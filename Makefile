# covey: `make run` starts the control plane on embedded defaults; `make test` runs the suite.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# Python writes its bytecode caches (__pycache__, ignored by git) even where the environment says
# not to: the tests start hundreds of Python processes, and each would compile covey anew (0.2 s).
unexport PYTHONDONTWRITEBYTECODE

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The services `make test` uses; scripts/test-services starts them when they are not up.
TEST_PG_PORT ?= 55432
TEST_REDIS_PORT ?= 56379
TEST_ENV := DATABASE_URL=postgres://covey@127.0.0.1:$(TEST_PG_PORT)/covey \
	CELERY_BROKER_URL=redis://127.0.0.1:$(TEST_REDIS_PORT)/0 \
	COVEY_TEST_PG_PORT=$(TEST_PG_PORT) COVEY_TEST_REDIS_PORT=$(TEST_REDIS_PORT)
PYTEST_ARGS ?=
# make test and make test-fast run the tests in this many pytest-xdist workers (tests/workers.py
# keeps them apart): two a core, as many tests wait on a process, a container or a socket.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) * 2 )))
FAST_MARKERS := not postgres and not redis and not docker and not e2e and not suite

.PHONY: help venv run test test-fast security-report soak lint format check services base-image test-debs egress-image control-plane-image workplace-image service-images lock

help:
	@echo "make run    start the control plane on http://127.0.0.1:8000 (SQLite, no servers needed)"
	@echo "make test   start PostgreSQL, Redis and Docker if needed, lint, run the whole suite"
	@echo "make test-fast  the tests that need no service, no Docker and no browser (no setup, under a minute)"
	@echo "make security-report  run the reliability and security suites, write docs/security.md's table"
	@echo "make soak   the long load and soak runs (10,000 tunnels, 1,000 held for 10 min, 5 min of load)"
	@echo "make lint   ruff, mypy and the import contracts only"
	@echo "make base-image  build the covey-base:trixie Docker image from Debian packages (no registry)"
	@echo "make egress-image  build covey-egress:latest, the egress proxy for runner hosts (on covey-base)"
	@echo "make control-plane-image  build covey:latest, the control plane for every role (on covey-base)"
	@echo "make workplace-image  build covey-workplace:latest, the default sandbox image with the Claude runtime"
	@echo "make service-images  build covey-postgres and covey-redis for compose.yaml (Debian packages, no registry)"
	@echo "make lock   lock pyproject.toml's dependencies into requirements/ (needs the package index)"

# The virtualenv is brought to the lock (requirements/dev.txt: pyproject.toml's dependencies and
# dev group, with hashes; scripts/lock makes it) only when the lock changes.
venv: $(STAMP)
$(STAMP): requirements/dev.txt
	@python=$$(scripts/find-python) || exit 1; \
	if [ ! -x $(PY) ] || ! $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
		rm -rf $(VENV) && $$python -m venv $(VENV); \
	fi
	$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes -r requirements/dev.txt
	@touch $(STAMP)

run: venv
	@scripts/run

services:
	@$(TEST_ENV) scripts/test-services

# Needs dockerd (services); instant when the image is up to date.
base-image: services
	@scripts/base-image

# The Debian packages the workplace build tests install (fetched once with apt in the base image).
test-debs: base-image
	@scripts/test-debs

# Wheels of the lock downloaded on the host (the venv's pip), installed in the image; instant
# when up to date.
egress-image: venv base-image
	@scripts/image egress

control-plane-image: venv base-image
	@scripts/image control-plane

# Debian packages fetched with apt in the base image, npm packages (requirements/workplace.txt)
# with the host's npm; instant when up to date.
workplace-image: base-image
	@scripts/workplace-image

# compose.yaml's PostgreSQL and Redis where no registry is reachable: Debian's packages on the
# local base; instant when up to date.
service-images: base-image
	@scripts/service-images

lock: venv
	@scripts/lock

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .
	$(VENV)/bin/lint-imports --no-cache

check: venv services
	$(TEST_ENV) $(PY) manage.py check --fail-level WARNING
	$(TEST_ENV) $(PY) manage.py makemigrations --check --dry-run

test: venv services base-image test-debs egress-image control-plane-image workplace-image service-images lint check
	$(TEST_ENV) $(VENV)/bin/pytest --numprocesses $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# No PostgreSQL, Redis, Docker or browser: SQLite and the in-memory fakes, in parallel.
test-fast: venv
	env -u DATABASE_URL -u CELERY_BROKER_URL $(VENV)/bin/pytest --numprocesses $(TEST_WORKERS) \
		--dist worksteal -m "$(FAST_MARKERS)" $(PYTEST_ARGS)

# The reliability and security suites (the tests marked suite), and their table in
# docs/security.md, written from their own output.
security-report: venv services base-image test-debs egress-image control-plane-image workplace-image service-images
	$(TEST_ENV) COVEY_SOAK_TUNNELS=1000 COVEY_SOAK_HELD_TUNNELS=200 COVEY_SOAK_SECONDS=15 \
		COVEY_LOAD_SECONDS=15 scripts/security-report $(PYTEST_ARGS)

# The long load and soak runs, which make test runs short: SOAK_TUNNELS tunnels open at once
# through one proxy (it needs 4 open files per tunnel, ulimit -n of 4 x (SOAK_TUNNELS + 100)
# + 256, and this process 2 x SOAK_TUNNELS + 1024), SOAK_HELD tunnels carrying traffic for SOAK_SECONDS, and the load on
# the runs API and the policy endpoint for LOAD_SECONDS. Prints their table; writes nothing.
SOAK_TUNNELS ?= 10000
SOAK_HELD ?= 1000
SOAK_SECONDS ?= 600
LOAD_SECONDS ?= 300
SOAK_TESTS := tests/security/test_load.py \
	tests/security/test_hostile_proxy.py::test_the_proxy_holds_thousands_of_open_tunnels_and_serves_the_next \
	tests/security/test_hostile_proxy.py::test_tunnels_held_for_minutes_do_not_grow_the_proxy
soak: venv services
	$(TEST_ENV) COVEY_SOAK_TUNNELS=$(SOAK_TUNNELS) COVEY_SOAK_HELD_TUNNELS=$(SOAK_HELD) \
		COVEY_SOAK_SECONDS=$(SOAK_SECONDS) COVEY_LOAD_SECONDS=$(LOAD_SECONDS) \
		scripts/security-report --print $(SOAK_TESTS)

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
