"""The bridge's connection to a Ray cluster (``ray.init``), and why one failed, in prefetchd's terms: a head
that is not there (``unreachable``, checked before Ray is imported), no cluster for ``auto``, Ray's client
missing, a head that wants a token (``connect_failure``)."""

from __future__ import annotations

import logging
import os
import socket

from prefetchd.daemon.config import usable_cpus

TOKEN_AUTH = ("start the daemon with RAY_AUTH_MODE=token and the cluster's token in ~/.ray/auth_token (or "
              "RAY_AUTH_TOKEN_PATH); see docs/SCALE.md, 'Token authentication'")
REACH_SECONDS = 5.0  # the TCP check of a head's address before ray.init (``unreachable``)


def connect(address: str) -> None:
    """``ray.init`` for a --ray address (checked by the config)."""
    import ray

    quiet = {"logging_level": logging.WARNING, "log_to_driver": False, "namespace": "prefetchd"}
    if address == "local":
        # The CPUs this process may use (taskset, cgroup cpusets, a CPU quota), not the machine's: Ray counts those.
        ray.init(address="local", num_cpus=usable_cpus(), include_dashboard=False, **quiet)  # type: ignore[arg-type]
    else:
        ray.init(address=address, **quiet)  # type: ignore[arg-type]


def unreachable(address: str) -> str:
    """Why nothing accepts a connection at a ``HOST:PORT`` or ``ray://HOST:PORT`` address, or "".

    ray.init does not fail for a head that is not there: it retries (tried with Ray 2.60, a port
    nobody listens on: still trying after 200 s) while the daemon says only "connecting".  A TCP
    connection to the same address fails at once for a refused port or an unknown host, and
    within ``REACH_SECONDS`` for one that drops packets, and says why."""
    if address in ("local", "auto"):
        return ""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=REACH_SECONDS).close()
    except socket.gaierror as exc:  # no such host: nothing to start there, the name is what to check
        return (f"its host name does not resolve here ({type(exc).__name__}: {exc.strerror or exc}); check the "
                "address (a name this machine's resolver knows, or the head's IP address)")
    except OSError as exc:  # refused, unreachable, TimeoutError
        return (f"nothing answers there ({type(exc).__name__}: {exc.strerror or exc}); start the head "
                "(`ray start --head`), or check the address and that its port is open to this machine")
    return ""


def connect_failure(address: str, exc: Exception) -> str:
    """Why ``connect`` failed, in prefetchd's terms (the daemon's warning names the address before it):
    for ``auto`` with no cluster found, Ray's own
    hint names its CLI's ``--address`` flag, which prefetchd does not have.  (RAY_ADDRESS, which
    ``auto`` follows when set, leaves Ray's message as it is: it names that address.)"""
    why = f"{type(exc).__name__}: {exc}"
    text = str(exc)
    if address == "auto" and isinstance(exc, ConnectionError) and not os.environ.get("RAY_ADDRESS"):
        why = ("no Ray cluster runs on this machine (--ray auto joins one that `ray start` started here); "
               "name a head with --ray HOST:6379, or use --ray local for a private one")
    elif "ray[client]" in text:
        why += ("; prefetchd[ray] does not install Ray's client: pip install 'ray[client]' (of the cluster's Ray "
                "version) here, or join the head's GCS with --ray HOST:6379")
    elif "auth" in text.lower():
        why += f"; {TOKEN_AUTH}"
    elif isinstance(exc, ConnectionError) and address not in ("local", "auto"):
        # A head with token authentication refuses a driver without the token, or with another one, with only
        # "Failed to connect to Ray cluster" after 20 s (Ray 2.60); its port answered (``unreachable``), so that is
        # the likeliest cause.
        if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
            why += ("; if the head uses token authentication (Ray 2.60 turns it on where a token exists when "
                    f"`ray start --head` runs): {TOKEN_AUTH}")
        else:
            why += ("; this daemon runs with RAY_AUTH_MODE=token: is its token the cluster's? It reads "
                    "RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token; "
                    "`ray get-auth-token` on the head prints the cluster's (docs/SCALE.md, 'Token authentication')")
    return why


__all__ = ["REACH_SECONDS", "TOKEN_AUTH", "connect", "connect_failure", "unreachable"]
