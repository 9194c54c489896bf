# The covey control plane (web + API). Build: docker build -t covey .
# BASE_IMAGE must provide Python 3.12+. Hosts that cannot pull build on the local base instead:
# make base-image, then --build-arg BASE_IMAGE=covey-base:trixie.
ARG BASE_IMAGE=python:3.12-slim-bookworm
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 COVEY_VAR_DIR=/var/lib/covey
WORKDIR /app
COPY requirements.txt .
RUN python3 -m venv /opt/covey && /opt/covey/bin/pip install --no-cache-dir -r requirements.txt
COPY . .
RUN useradd --system --home-dir /var/lib/covey --create-home covey \
    && DJANGO_SECRET_KEY=build /opt/covey/bin/python manage.py collectstatic --no-input -v0
USER covey
EXPOSE 8000
CMD ["/opt/covey/bin/gunicorn", "covey.wsgi", "--bind", "0.0.0.0:8000", "--workers", "3"]
