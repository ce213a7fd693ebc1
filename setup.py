"""Builds the C kernels into the wheel (kernels/prebuilt/), once per instruction set that the
runtime chooses from (kernels/native.py), so an installed pagedserve needs no compiler. The rest
of the package is declared in pyproject.toml."""

import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution


class BuildKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # a source tree compiles its kernels on first use
            return
        compiler = shutil.which(os.environ.get("CC", "cc"))
        if compiler is None:
            self.warn(
                "no C compiler: the wheel carries no prebuilt kernels (they compile on first use, or run in torch)"
            )
            return
        spec = importlib.util.spec_from_file_location("native", Path(__file__).parent / "kernels" / "native.py")
        native = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(native)  # the standard library only: no torch at build time
        built = native.build_prebuilt(Path(self.build_lib) / "kernels" / "prebuilt", compiler)
        self.announce(f"prebuilt kernels: {', '.join(p.name for p in built)}", level=2)


class BinaryDistribution(Distribution):
    """The wheel holds compiled libraries, so it is tagged for this platform."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildKernels}, distclass=BinaryDistribution)
