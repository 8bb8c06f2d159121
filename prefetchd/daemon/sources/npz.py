"""Reading the ``.npz`` files prefetchd writes (shard indexes, index-cache entries), never unpickling."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Collection
from typing import IO

import numpy as np


def load_arrays(file: str | os.PathLike[str] | IO[bytes],
                names: Collection[str] | None = None) -> dict[str, np.ndarray]:
    """Every array in ``file``, or those of ``names`` it holds (the others' bytes are not read, from a
    seekable file); a ``ValueError`` saying what is wrong with one prefetchd cannot have written.

    numpy takes any bytes that are neither a zip nor a ``.npy`` for a pickle, and its refusal
    says "If you trust the file you can load it unsafely": the wrong advice for an index
    that was damaged, since prefetchd writes no pickles.  ``OSError`` (cannot read it) passes."""
    try:
        loaded = np.load(file, allow_pickle=False)
    except EOFError:
        raise ValueError("the file is empty") from None
    except zipfile.BadZipFile as exc:
        raise ValueError(f"a broken zip archive ({exc})") from None
    except ValueError as exc:
        if "pickle" not in str(exc):
            raise
        raise ValueError("not a numpy .npz archive: its first bytes are neither a zip nor numpy's header") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError("a single numpy array (.npy), not the .npz archive of arrays prefetchd writes")
    with loaded as npz:
        try:
            return {k: npz[k] for k in npz.files if names is None or k in names}
        except ValueError as exc:
            if "allow_pickle" not in str(exc):
                raise
            raise ValueError("it holds object (pickled) arrays, which prefetchd never writes") from None
        except (zipfile.BadZipFile, EOFError) as exc:
            raise ValueError(f"a broken zip archive ({exc})") from None
