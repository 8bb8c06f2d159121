"""The optional C extension; everything else about the package is in pyproject.toml.

``prefetchd.daemon._cropjpeg`` decodes only the part of a JPEG a crop keeps and resizes
the crop as torch would, so that a worker needs no torch (issue 16, docs/BENCHMARKS.md).
``optional=True``: where there is no C compiler or no libjpeg-turbo headers the build
warns and the install goes on without it, and the daemon decodes whole images and
resizes with torch as before (``prefetchd start`` says which decoder runs).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("prefetchd.daemon._cropjpeg",
                             ["prefetchd/daemon/_cropjpeg.c", "prefetchd/daemon/_resample.c"],
                             depends=["prefetchd/daemon/_resample.h"], libraries=["jpeg"], optional=True)])
