"""Local paths and object-storage URLs, for the daemon's datasets and the trainer's checkpoints.

A location is a local path or an fsspec URL (``s3://bucket/prefix``, ``gs://...``).
Both processes use this module, so neither imports the other.  fsspec and its
backends (s3fs, gcsfs) are imported only when a URL is used; credentials come
from the backend's standard environment and config files, never from ours.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# The extra of ours that installs a backend, where we ship one.
EXTRAS = {"s3": "prefetchd[s3]", "s3a": "prefetchd[s3]"}


class LocationError(ValueError):
    """A URL that cannot be opened here: unknown protocol or its package missing."""


def is_url(location: str) -> bool:
    """``s3://bucket/x`` and other fsspec URLs; a local path (even with a colon) is not one."""
    scheme, sep, _ = location.partition("://")
    return bool(sep) and scheme.isidentifier() and len(scheme) > 1


def normalize(location: str | os.PathLike[str], base: Path | None = None) -> str:
    """A URL verbatim (less a trailing slash); a local path with ``~`` expanded, made absolute against ``base`` or the cwd."""
    text = os.fspath(location)
    if is_url(text):
        return text.rstrip("/") if not text.endswith("://") else text
    path = Path(text).expanduser()
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    return os.path.normpath(path)


def protocol(url: str) -> str:
    return url.partition("://")[0]


def filesystem(url: str) -> tuple[Any, str]:
    """A fresh fsspec filesystem for ``url`` and the path within it.

    Fresh (not fsspec's per-process instance cache) because its async backends
    hold an event loop and connections that must not cross a fork, and because a
    cached instance keeps stale listings.
    """
    proto = protocol(url)
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ImportError:
        raise LocationError(f"{url}: reading URLs needs fsspec: pip install '{EXTRAS.get(proto, 'fsspec')}'") from None
    if proto not in known_implementations and proto not in fsspec.available_protocols():
        raise LocationError(f"{url}: unknown protocol {proto!r}; fsspec knows "
                            f"{', '.join(sorted(fsspec.available_protocols()))}")
    options: dict[str, Any] = {"skip_instance_cache": True}
    if proto in ("s3", "s3a"):
        # Retries are ours (with backoff, jitter and a log line); botocore's own
        # would multiply them and hide the outage.
        options["config_kwargs"] = {"retries": {"total_max_attempts": 1}}
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        hint = f"pip install '{EXTRAS[proto]}'" if proto in EXTRAS else known_implementations.get(proto, {}).get("err", str(exc))
        raise LocationError(f"{url}: {proto}:// needs a package that is not installed: {hint}") from None
    if proto in ("s3", "s3a"):
        fs.retries = 1  # s3fs's own retry loop (a class attribute, not an option), for the same reason
    return fs, str(path).rstrip("/")
