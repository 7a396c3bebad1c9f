"""Compiles protos/ into phalanx._proto during every build, editable ones included."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


def _generate_stubs() -> None:
    script = Path(__file__).resolve().parent / "scripts" / "gen_protos.py"
    spec = importlib.util.spec_from_file_location("gen_protos", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate()


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        _generate_stubs()
        super().run()


# Generated before setup() as well: setuptools discovers packages before
# build_py runs, and phalanx._proto must exist by then to be packaged.
_generate_stubs()
setup(cmdclass={"build_py": BuildPyWithProtos})
