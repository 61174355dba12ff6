"""``server/lifecycle.py``: how an engine's failure becomes the client's answer."""

from __future__ import annotations

import pytest

from grserve.engine.protocol import EngineError
from grserve.server.http.lifecycle import engine_failure


class _Busy(EngineError):
    http_status = 429
    error_type = "overloaded"


class _Gone(EngineError):
    http_status = 503
    error_type = "request_lost"


class _Conflict(EngineError):
    http_status = 409
    error_type = "conflict"


def test_an_engine_error_naming_429_or_503_carries_retry_after():
    """The hostile pass (issue 25): behind ``serve --instances 3``, a request the front end admitted and whose
    instance's queue was full came back 429 ``overloaded`` without ``Retry-After`` (the error names its status,
    ``InstanceOverloaded``; ``RequestLost`` is a 503 alike). Every 429 and 503 says when to retry; others do not."""
    for exc, status in ((_Busy("instance 1: 16 requests waiting"), 429), (_Gone("no instance left"), 503)):
        err = engine_failure(exc, "r1")
        assert (err.status, err.type) == (status, exc.error_type)
        assert err.headers == {"Retry-After": "1"}, err.headers
    assert not engine_failure(_Conflict("x"), "r1").headers


def test_the_cluster_errors_carry_retry_after():
    pytest.importorskip("ray")
    from grserve.cluster.core.recovery import RequestLost
    from grserve.cluster.gr.front_end import InstanceOverloaded

    assert engine_failure(InstanceOverloaded("full"), "r1").headers == {"Retry-After": "1"}
    assert engine_failure(RequestLost("lost"), "r1").headers == {"Retry-After": "1"}
