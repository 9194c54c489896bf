"""covey: a self-hosted control plane for AI coding agents."""

from covey.celery import app as celery_app

__all__ = ("celery_app",)
