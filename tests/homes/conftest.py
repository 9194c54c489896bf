"""What the end-to-end homes tests share: a control plane and runner processes (tests/runners/
stack.py), stopped and removed afterwards."""

import pytest

from tests.runners.stack import Stack


@pytest.fixture
def stack(tmp_path, base_image):
    built = Stack(tmp_path, base_image)
    yield built
    built.close()
