"""The optional C extension; everything else about the package is in pyproject.toml.

``prefetchd.daemon._cropjpeg`` decodes only the part of a JPEG a crop keeps and resizes
the crop as torch would, so that a worker needs no torch (issue 16, docs/BENCHMARKS.md).
``optional=True``: where there is no C compiler or no libjpeg-turbo headers the build
warns and the install goes on without it, and the daemon decodes whole images and
resizes with torch as before (``prefetchd start`` says which decoder runs).  The digest
of its sources is built in, so that the daemon tells an extension built from other
sources (``prefetchd/daemon/extension_sources.py``).
"""

import importlib.util
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DAEMON = Path(__file__).parent / "prefetchd" / "daemon"
_spec = importlib.util.spec_from_file_location("extension_sources", DAEMON / "extension_sources.py")
assert _spec is not None and _spec.loader is not None
sources = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sources)


class BuildExtension(build_ext):
    """A build that fails leaves no extension behind: an upgrade's build without a compiler installed the one an
    earlier build had left in build/ (or, in place, kept the checkout's), built from other sources (a walk)."""

    in_place = False

    def run(self) -> None:
        self.in_place = bool(self.inplace)  # setuptools builds in build/ even so, then copies into the checkout
        super().run()

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception:
            package, name = ext.name.rsplit(".", 1)
            in_checkout = os.path.join(*package.split("."), os.path.basename(self.get_ext_filename(name)))
            for built in (self.get_ext_fullpath(ext.name), *([in_checkout] if self.in_place else [])):
                if os.path.exists(built):
                    os.remove(built)
            raise


setup(
    cmdclass={"build_ext": BuildExtension},
    ext_modules=[Extension(
        "prefetchd.daemon._cropjpeg",
        [f"prefetchd/daemon/{name}" for name in sources.SOURCES if name.endswith(".c")],
        depends=[f"prefetchd/daemon/{name}" for name in sources.SOURCES if name.endswith(".h")],
        define_macros=[("PREFETCHD_SOURCE_DIGEST", f'"{sources.source_digest(DAEMON)}"')],
        libraries=["jpeg"], optional=True)],
)
