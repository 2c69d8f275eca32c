"""Build of orchard_ops (the C extension) and the orchard Python package."""
import glob
import sys

import numpy
from setuptools import Extension, setup

VERSION = "0.1.0"

extra_compile_args = ["-std=gnu11", "-O3", "-fno-math-errno", "-fvisibility=hidden", "-Wall",
                      "-Wno-unused-function"]
if sys.platform == "darwin":
    extra_compile_args.remove("-fno-math-errno")

orchard_ops = Extension(
    "orchard_ops",
    sources=sorted(glob.glob("csrc/*.c")),
    depends=sorted(glob.glob("csrc/*.h")),
    include_dirs=[numpy.get_include(), "csrc"],
    define_macros=[("ORCHARD_VERSION", f'"{VERSION}"')],
    extra_compile_args=extra_compile_args,
    libraries=["m", "pthread"],
)

setup(version=VERSION, ext_modules=[orchard_ops])
