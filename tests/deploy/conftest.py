"""The compose test's Docker Engine: docker_engine.py builds it and every image; here it is a session fixture."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from docker_engine import DockerEngine, docker_engine_with_images


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[DockerEngine]:
    """The test's own dockerd with the images built; stopped (by its PID) after the session."""
    with docker_engine_with_images() as engine:
        yield engine
