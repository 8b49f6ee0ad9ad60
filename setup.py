"""pip install builds jpegcrop's C library (wdsdist/data/decode/jpegcrop.c) beside the package;
the rest of the project's metadata is pyproject.toml's. Where it cannot be built (no C compiler,
no libjpeg-turbo headers: Debian's gcc libjpeg62-turbo-dev) the install goes on without it
(``optional``), and the loader builds it on first use or, failing that, says why in one line and
decodes whole images. The library carries the source's tag, so an installed build of other code
is never used (jpegcrop.installed)."""

import hashlib
import platform
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCE = Path("wdsdist/data/decode/jpegcrop.c")
TAG = hashlib.sha256(SOURCE.read_bytes() + platform.machine().encode()).hexdigest()[:12]


class CLibrary(build_ext):
    """A plain C library that ctypes opens: no Python module, so no init function to export."""

    def get_export_symbols(self, ext):
        return []


setup(
    ext_modules=[
        Extension(
            "wdsdist.data.decode._jpegcrop",
            sources=[str(SOURCE)],
            libraries=["jpeg", "m"],
            extra_compile_args=["-O3", "-ffp-contract=off", f'-DJPEGCROP_TAG="{TAG}"'],
            optional=True,
        )
    ],
    cmdclass={"build_ext": CLibrary},
)
