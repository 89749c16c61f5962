"""JSON over HTTP with the standard library, and what a failed request was.

The clients of OpenAI-compatible servers (`bench.serve_load`, `data.regenerate_served`) need the
same two calls and the same reading of a failure: a 4xx answer is the request's fault (sending
it again changes nothing), anything else (a 5xx, a refused or dropped connection, a timeout, a
body that is not JSON) is the server's, worth another try. `RequestFailed` carries that
distinction (``status``: the HTTP code, None when no readable answer came), so no caller has to
know urllib's exception tree. No third-party HTTP library: these clients run in the training
environment, which need not have one.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any

__all__ = ["RequestFailed", "get_json", "post_json"]


class RequestFailed(Exception):
    """A request that got no usable JSON answer.

    ``status`` is the HTTP status of an error answer, None when there was none (no connection,
    a dropped one, a timeout) or when the answer was not JSON. The message is ``"CODE: body"``
    for an error answer (its first 300 characters), else the underlying error's repr.
    """

    def __init__(self, message: str, *, url: str, status: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.status = status

    @property
    def client_error(self) -> bool:
        """The server answered that the request itself is wrong (a 4xx): do not send it again."""
        return self.status is not None and self.status < 500


def _json_call(request: urllib.request.Request, timeout: float) -> Any:
    url = request.full_url
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            data = answer.read()
    except urllib.error.HTTPError as failure:
        try:
            detail = failure.read()[:300].decode(errors="replace")
        except (OSError, http.client.HTTPException):
            detail = ""
        raise RequestFailed(f"{failure.code}: {detail}", url=url, status=failure.code) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as failure:
        raise RequestFailed(repr(failure), url=url) from None
    try:
        return json.loads(data)
    except ValueError as failure:  # not JSON (UnicodeDecodeError is a ValueError too)
        raise RequestFailed(repr(failure), url=url) from None


def get_json(url: str, *, timeout: float = 60.0) -> Any:
    """``GET url`` and its JSON answer; `RequestFailed` otherwise."""
    return _json_call(urllib.request.Request(url), timeout)


def post_json(url: str, body: Any, *, timeout: float = 600.0) -> Any:
    """``POST`` `body` as JSON to `url` and return the JSON answer; `RequestFailed` otherwise."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    return _json_call(request, timeout)
