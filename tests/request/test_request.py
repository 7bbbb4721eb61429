"""The request value object: what a caller builds is what the intake reads."""

from __future__ import annotations

import pickle

import pytest

from stoic.request import Request, SamplingParams


def test_a_request_keeps_token_ids_and_messages_as_tuples_and_always_has_an_id() -> None:
    """Lists become tuples (a request is plain immutable data); without a request id (or with
    an empty one) each request gets a fresh one."""
    messages = [{"role": "user", "content": "hi"}]
    a, b = Request([1, 2]), Request(messages=messages, request_id="")
    assert a.prompt == (1, 2) and b.messages == tuple(messages)
    assert a.request_id.startswith("req-") and b.request_id.startswith("req-")
    assert a.request_id != b.request_id
    assert pickle.loads(pickle.dumps(b)) == b


def test_request_of_builds_from_keywords_or_replaces_fields_of_a_request() -> None:
    """``Request.of`` is the one place keyword arguments become a request: a prompt (positional
    or by name), params and the other fields by name; given a request, the fields replace its
    own; a name that is no field raises TypeError."""
    params = SamplingParams(max_tokens=3)
    built = Request.of("hi", params, request_id="r1", add_special_tokens=False)
    assert built == Request("hi", params, request_id="r1", add_special_tokens=False)
    assert Request.of(prompt="hi", request_id="r1") == Request("hi", request_id="r1")
    assert Request.of(built) is built
    replaced = Request.of(built, SamplingParams(max_tokens=5), request_id="r2")
    assert (replaced.prompt, replaced.params.max_tokens, replaced.request_id) == ("hi", 5, "r2")
    assert not replaced.add_special_tokens
    with pytest.raises(TypeError, match="no_such_field"):
        Request.of("hi", no_such_field=1)
