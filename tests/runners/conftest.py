"""Fixtures for the runner tests that need Docker."""

import os
import subprocess

import pytest

# Newest first: the base image moves from bookworm to trixie.
BASE_IMAGES = ("covey-base:trixie", "covey-base:bookworm")


def _image_exists(image: str) -> bool:
    try:
        inspect = subprocess.run(
            ["docker", "image", "inspect", image], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return inspect.returncode == 0


@pytest.fixture(scope="session")
def base_image() -> str:
    """The locally built base image; skips without it, but fails under CI=true."""
    for image in BASE_IMAGES:
        if _image_exists(image):
            return image
    message = f"none of {', '.join(BASE_IMAGES)} is on this host: run `make base-image`"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)
