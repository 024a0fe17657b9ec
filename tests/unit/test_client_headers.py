"""A producer's ``headers=``: each bad one is refused with one line naming it, before
anything is stored. A header holding a lone surrogate (text decoded with
``surrogateescape``) used to raise pydantic's serialization traceback for a value, and for
a name to be stored silently as another name (U+FFFD in its place)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from qcluster import Client
from qcluster.errors import EnvelopeError
from qcluster.job import decode_envelope, encode_new_jobs


def _encode(headers: Any) -> list[tuple[str, bytes]]:
    return encode_new_jobs("q", [{"n": 1}], enqueued_at=1.0, random_bytes=os.urandom,
                           headers=headers)


@pytest.mark.parametrize(("headers", "said"), [
    ({"tenant": 7}, r"header 'tenant': Input should be a valid string"),
    ({"tenant": None}, r"header 'tenant': Input should be a valid string"),
    ({7: "tenant"}, r"header name 7: Input should be a valid string"),
    ([("tenant", "a")], r"headers: Input should be a valid dictionary"),
    ({"tenant": "caf\udce9"}, r"headers must be UTF-8 text: header 'tenant' holds"),
    ({"caf\udce9": "x"}, r"headers must be UTF-8 text: header 'caf\\udce9' holds"),
])
def test_a_bad_header_is_refused_in_one_line_naming_it(headers: Any, said: str) -> None:
    with pytest.raises(EnvelopeError, match=r"^job for queue 'q': " + said) as raised:
        _encode(headers)
    assert "\n" not in str(raised.value)


def test_text_headers_arrive_as_they_were_sent() -> None:
    headers = {"tenant": "café", "": "empty name", "traceparent": "00-1-2-01", "n\x00": "\x00"}
    [(_, body)] = _encode(headers)
    assert decode_envelope(body).headers == headers


def test_a_bad_header_stores_nothing(redis_url: str) -> None:
    with Client(redis_url) as client:
        client.purge("bad-headers")
        with pytest.raises(EnvelopeError):
            client.enqueue_many("bad-headers", [{"n": 1}, {"n": 2}],
                                headers={"tenant": "caf\udce9"})
        assert client.stats("bad-headers")["ready"] == 0
