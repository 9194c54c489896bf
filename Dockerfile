# The covey control plane: one image for every role, `docker run covey:latest ROLE` (web, the
# default, worker, runner, proxy, gateway, migrate: covey/entrypoint.py says what each waits for
# and runs; any other program runs as given). Build it with `make control-plane-image`
# (scripts/image control-plane), not `docker build .`: the script makes the build context, with
# requirements/control-plane.txt (pyproject.toml's dependencies, locked with hashes: no
# development or test tool) and their wheels, downloaded on the host, under wheels/ (nothing is
# fetched during the build), and under src/ manage.py and the apps (no tests, .git, .venv or
# var/).
#
# BASE_IMAGE: any Debian-like image with python3 (3.12+, and its venv module) and useradd. The
# default is the public slim Python image; `make control-plane-image` builds on the local
# covey-base:trixie (`make base-image`, from Debian packages) unless BASE_IMAGE says otherwise.
ARG BASE_IMAGE=python:3.13-slim-trixie

# The virtualenv, installed from the local wheels alone; only /opt/covey leaves this stage,
# which the script keeps (untagged) as build cache, so a change to the sources alone does not
# reinstall it; STAGE_KEY (a hash of the wheels, this file and the base) tells it which older
# ones to remove.
FROM ${BASE_IMAGE} AS venv
ARG STAGE_KEY=unknown
LABEL covey.control-plane-stage=venv covey.control-plane-stage-key=${STAGE_KEY}
COPY requirements.txt /build/requirements.txt
COPY wheels /build/wheels
RUN python3 -m venv /opt/covey \
    && /opt/covey/bin/pip install --quiet --no-index --find-links /build/wheels \
        --no-cache-dir --disable-pip-version-check --require-hashes -r /build/requirements.txt \
    && /opt/covey/bin/pip uninstall --quiet --yes pip

FROM ${BASE_IMAGE}
ENV PATH=/opt/covey/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    COVEY_VAR_DIR=/var/lib/covey \
    COVEY_STATIC_ROOT=/app/static
# /var/lib/covey/runners/builtin: where the web role leaves the built-in runners' identities for
# the runner role (a volume shared by both in compose.yaml takes the folder's owner from here).
RUN useradd --system --user-group --home-dir /var/lib/covey --create-home \
        --shell /usr/sbin/nologin covey \
    && install -d -o covey -g covey /var/lib/covey/runners /var/lib/covey/runners/builtin
COPY --from=venv /opt/covey /opt/covey
WORKDIR /app
COPY src/ /app/
# Static files and bytecode now: the running container need not write under /app.
RUN DJANGO_SECRET_KEY=build-only COVEY_VAR_DIR=/tmp/build python manage.py collectstatic \
        --no-input --verbosity 0 \
    && rm -rf /tmp/build \
    && python -m compileall -q -x '^/app/manage\.py$' /app
USER covey
EXPOSE 8000
ENTRYPOINT ["python", "-m", "covey.entrypoint"]
CMD ["web"]
