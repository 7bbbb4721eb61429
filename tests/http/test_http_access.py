"""API keys and the admin key: who may call which route (no model: a scripted engine)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
import openai
import pytest
from aiohttp.test_utils import make_mocked_request
from http_fakes import FakeEngine
from http_helpers import chat_body, metric, serving

from stoic import EngineConfig
from stoic.http import AccessPolicy, create_app, load_keys
from stoic.http._auth import ACCESS, _check

_session_loop = pytest.mark.asyncio(loop_scope="session")

KEYS = AccessPolicy(api_keys=("sk-one", "sk-two"), admin_key="adm-1")


def _fault_engine() -> FakeEngine:
    return FakeEngine(config=EngineConfig(model="fake", enable_fault_injection=True))


def _bearer(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


async def _status(
    http: aiohttp.ClientSession, method: str, url: str, key: str | None, **kw: Any
) -> tuple[int, dict[str, Any] | None, aiohttp.typedefs.LooseHeaders]:
    async with http.request(method, url, headers=_bearer(key), **kw) as r:
        body = await r.json() if r.content_type == "application/json" else None
        return r.status, body, r.headers


@_session_loop
async def test_without_keys_every_api_route_is_open() -> None:
    """No key configured: the OpenAI routes answer without an Authorization header."""
    async with serving(FakeEngine()) as (url, _, _), aiohttp.ClientSession() as http:
        status, _, _ = await _status(
            http, "POST", f"{url}/v1/chat/completions", None, json=chat_body()
        )
        assert status == 200


@_session_loop
async def test_api_routes_need_a_configured_key() -> None:
    """With keys: no key or a wrong one is a 401 with OpenAI error JSON and a Bearer challenge
    (the engine never sees the request); each configured key works; the admin key is not an
    API key; /health stays open (GET and HEAD); unknown paths are 401, not a route map."""
    engine = FakeEngine()
    async with serving(engine, access=KEYS) as (url, _, _), aiohttp.ClientSession() as http:
        chat = f"{url}/v1/chat/completions"
        for key in (None, "sk-wrong", "adm-1", "sk-one-and-more"):
            status, body, headers = await _status(http, "POST", chat, key, json=chat_body())
            assert status == 401, key
            assert body is not None and body["error"]["type"] == "authentication_error"
            assert body["error"]["code"] == "invalid_api_key"
            assert headers["WWW-Authenticate"].startswith("Bearer")
            assert headers["x-should-retry"] == "false"
        assert engine.streams == []
        for key in ("sk-one", "sk-two"):
            assert (await _status(http, "POST", chat, key, json=chat_body()))[0] == 200
            assert (await _status(http, "GET", f"{url}/v1/models", key))[0] == 200
        assert len(engine.streams) == 2
        assert (await _status(http, "GET", f"{url}/v1/models", None))[0] == 401
        assert (await _status(http, "GET", f"{url}/health", None))[0] == 200
        assert (await _status(http, "HEAD", f"{url}/health", None))[0] == 200
        assert (await _status(http, "GET", f"{url}/metrics", None))[0] == 200
        assert (await _status(http, "GET", f"{url}/nowhere", None))[0] == 401
        assert (await _status(http, "GET", f"{url}/nowhere", "sk-one"))[0] == 404
        assert await metric(url, 'stoic_http_refused_total{reason="unauthorized"}') == 6


@_session_loop
async def test_the_openai_sdk_sees_an_authentication_error() -> None:
    """The official SDK raises AuthenticationError for a wrong key and works with a right one."""
    async with serving(FakeEngine(), access=KEYS) as (url, _, _):
        wrong = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-nope", max_retries=0)
        right = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-two", max_retries=0)
        async with wrong, right:
            with pytest.raises(openai.AuthenticationError):
                await wrong.models.list()
            models = await right.models.list()
            assert [m.id for m in models.data] == ["fake-model"]


@_session_loop
async def test_metrics_require_key_closes_metrics() -> None:
    """--metrics-require-key: /metrics needs an API key or the admin key; /health stays open."""
    policy = AccessPolicy(api_keys=("sk-one",), admin_key="adm-1", metrics_require_key=True)
    async with serving(FakeEngine(), access=policy) as (url, _, _), aiohttp.ClientSession() as http:
        metrics = f"{url}/metrics"
        assert (await _status(http, "GET", metrics, None))[0] == 401
        assert (await _status(http, "GET", metrics, "sk-wrong"))[0] == 401
        assert (await _status(http, "GET", metrics, "sk-one"))[0] == 200
        assert (await _status(http, "GET", metrics, "adm-1"))[0] == 200
        assert (await _status(http, "GET", f"{url}/health", None))[0] == 200


@_session_loop
async def test_admin_routes_need_the_admin_key_never_an_api_key() -> None:
    """With an admin key: the admin key passes; an API key is a 403 (known, not allowed); no key
    or a wrong one is a 401. The API routes do not take the admin key."""
    engine = _fault_engine()
    async with serving(engine, access=KEYS) as (url, _, _), aiohttp.ClientSession() as http:
        faults = f"{url}/admin/faults"
        assert (await _status(http, "DELETE", faults, None))[0] == 401
        assert (await _status(http, "DELETE", faults, "nope"))[0] == 401
        status, body, _ = await _status(http, "DELETE", faults, "sk-one")
        assert status == 403 and body is not None
        assert body["error"]["type"] == "permission_error"
        assert await metric(url, 'stoic_http_refused_total{reason="forbidden"}') == 1
        assert (await _status(http, "DELETE", faults, "adm-1"))[0] == 200
        assert (await _status(http, "GET", f"{url}/v1/models", "adm-1"))[0] == 401


@_session_loop
async def test_admin_routes_without_an_admin_key_answer_loopback_only() -> None:
    """No admin key: a loopback client may use the admin routes, any other address gets 403
    (checked on the access rule itself: tests may bind to 127.0.0.1 only)."""
    engine = _fault_engine()
    async with serving(engine) as (url, _, _), aiohttp.ClientSession() as http:
        assert (await _status(http, "DELETE", f"{url}/admin/faults", None))[0] == 200
    policy = AccessPolicy(api_keys=("sk-one",))
    for peer, expected in (("127.0.0.1", None), ("::1", None), ("10.1.2.3", 403), ("", 403)):
        transport = mock.Mock()
        transport.get_extra_info.return_value = (peer, 5555) if peer else None
        request = make_mocked_request("DELETE", "/admin/faults", transport=transport)
        refused = _check(policy, "admin", request)
        assert (refused.status if refused else None) == expected, peer
        with_key = make_mocked_request(  # an API key does not open them either
            "DELETE", "/admin/faults", headers=_bearer("sk-one"), transport=transport
        )
        refused = _check(policy, "admin", with_key)
        assert (refused.status if refused else None) == expected, peer


def test_every_route_has_an_access_class() -> None:
    """Every registered route is classified; only /health is open and only /admin/* is admin,
    so a route added later without thought is protected (unclassified means ``api``)."""
    app = create_app(_fault_engine())
    table = app[ACCESS]
    paths = {r.resource.canonical: table.get(r.resource) for r in app.router.routes() if r.resource}
    assert paths["/health"] == "open"
    assert paths["/metrics"] == "metrics"
    assert {p for p, a in paths.items() if a == "admin"} == {"/admin/faults"}
    assert all(a == "api" for p, a in paths.items() if p.startswith("/v1/"))


def test_keys_load_from_flags_env_and_files(tmp_path: Path) -> None:
    """Keys come from the flags, else the environment variable, plus key files (blank lines
    and comments skipped, duplicates once); a policy never shows its keys in its repr."""
    keyfile = tmp_path / "keys"
    keyfile.write_text("# team keys\nsk-a\n\n  sk-b  \nsk-a\n")
    with mock.patch.dict(os.environ, {"STOIC_TEST_KEY": "sk-env"}):
        assert load_keys(None, [keyfile], "STOIC_TEST_KEY") == ("sk-env", "sk-a", "sk-b")
        assert load_keys(["sk-flag"], None, "STOIC_TEST_KEY") == ("sk-flag",)
    assert load_keys(None, None, "STOIC_TEST_UNSET_KEY") == ()
    policy = AccessPolicy(api_keys=("sk-secret",), admin_key="adm-secret")
    assert "secret" not in repr(policy)
    assert policy.is_api_key("sk-secret") and not policy.is_api_key("sk-secre")
    assert policy.is_admin_key("adm-secret") and not policy.is_admin_key("sk-secret")


@pytest.mark.parametrize(
    ("api", "admin"), [(("",), None), ((" sk",), None), (("sk-a",), "sk-a"), ((), "")]
)
def test_bad_keys_are_refused(api: tuple[str, ...], admin: str | None) -> None:
    """An empty key, one with surrounding whitespace, or the admin key reused as an API key is
    a configuration error."""
    with pytest.raises(ValueError, match="key"):
        AccessPolicy(api_keys=api, admin_key=admin)
