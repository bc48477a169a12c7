"""Hugging Face Hub calls with deadlines: a Hub that accepts a connection and never answers is one error line in
seconds, not a hang.

huggingface_hub (1.x and later) sends every request through one shared httpx client created without a timeout,
and some calls (``repo_info``, which ``snapshot_download`` makes first) pass ``timeout=None`` explicitly, which
a client default cannot override. So the deadline is set on each request as it is sent (a request hook on huggingface_hub's own client): it gets a connect timeout
and a read timeout (``/api/`` answers: the metadata timeout; file bytes: the download timeout, see
:func:`exl3rt.env.hub_timeouts`), whatever the caller asked for.
"""

from __future__ import annotations

from typing import Any

from .. import env

_INSTALLED = False


def install_timeouts() -> bool:
    """Make huggingface_hub's shared client use deadlines (once per process); False where this huggingface_hub
    does not send its requests through a client factory (older releases use requests and their own timeouts)."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        from huggingface_hub.utils import _http
    except ImportError:
        return False
    factory = getattr(_http, "default_client_factory", None)
    setter = getattr(_http, "set_client_factory", None)
    if factory is None or setter is None:
        return False
    metadata, download = env.hub_timeouts()

    def deadline(request: Any) -> None:
        read = metadata if "/api/" in request.url.path else download
        request.extensions["timeout"] = {"connect": metadata, "read": read, "write": read, "pool": metadata}

    def client() -> Any:
        # huggingface_hub's own client (its hooks, the environment's proxies), with the deadline set on each request
        c = factory()
        c.event_hooks = {**c.event_hooks, "request": [deadline, *c.event_hooks.get("request", [])]}
        return c

    setter(client)
    _INSTALLED = True
    return True


def describe_hub_failure(exc: BaseException) -> str:
    """Why a Hub call failed, in a few words: a timeout says which endpoint, how long, and which variable waits
    longer; anything else is the error's first line."""
    chain, e = [], exc
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any("timeout" in type(e).__name__.lower() or "timed out" in str(e).lower() for e in chain):
        try:
            from huggingface_hub import constants
            where = f" at {constants.ENDPOINT}"
        except ImportError:
            where = ""
        metadata, _ = env.hub_timeouts()
        return (f"the Hub{where} did not answer within {metadata:g} s; HF_HUB_ETAG_TIMEOUT and "
                f"HF_HUB_DOWNLOAD_TIMEOUT set longer waits")
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__
