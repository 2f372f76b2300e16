"""Builds the CFFI `_native` module and the static `bunshin-init` binary."""

import os
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def build_init(dest_dir: str) -> None:
    os.makedirs(dest_dir, exist_ok=True)
    out = os.path.join(dest_dir, "bunshin-init")
    # Static, so it runs in any root file system, whatever its libc.
    subprocess.check_call(
        ["cc", "-O2", "-static", "-Wall", "-Wextra", "-o", out,
         os.path.join(HERE, "csrc", "init.c"), os.path.join(HERE, "csrc", "watchdog.c")]
    )
    subprocess.check_call(["strip", out])


class BuildPy(build_py):
    def run(self) -> None:
        build_init(os.path.join(HERE, "bunshinfork", "_bin"))
        super().run()


# Made before setup() discovers the packages, so bunshinfork._bin (built later, by build_py) is
# one of them.
os.makedirs(os.path.join(HERE, "bunshinfork", "_bin"), exist_ok=True)
setup(
    cffi_modules=["bunshinfork/_build_native.py:ffibuilder"],
    cmdclass={"build_py": BuildPy},
)
