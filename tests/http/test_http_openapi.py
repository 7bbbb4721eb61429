"""``/openapi.json`` and a schemathesis run against ``stoic serve``: generated requests, valid
and invalid, never get a 5xx, and every response conforms to the document (status, content
type, headers, body schema).

The server is ``python -m stoic serve`` on the tiny random model with a short context (so a
generated ``max_tokens`` of millions ends in milliseconds) and an API key (every generated call
carries it). The admin routes are not fuzzed: a fuzzer arming faults would make the other
routes fail by design; their validation has its own tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from stoic.http._openapi import openapi_document

KEY = "sk-fuzz"
_CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
]


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``stoic serve`` on the tiny model (its log in a file); yields its base URL."""
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    cmd = [sys.executable, "-m", "stoic", "serve", "--model", str(tiny_model_dir)]
    cmd += ["--port", "0", "--dtype", "float32", "--executor", "thread", "--max-model-len", "64"]
    cmd += ["--num-kv-blocks", "128", "--api-key", KEY, "--log-format", "json"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stderr=out, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        url = None
        while url is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            for line in log.read_text().splitlines():
                if '"stoic.ready"' in line:
                    url = json.loads(line)["url"]
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


#: the document the app serves (the served copy is checked equal to it below); built from
#: the code, so the fuzz needs no server at collection time
schema = schemathesis.openapi.from_dict(openapi_document(admin=False, version="test"))


@schema.parametrize()
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_generated_requests_get_no_5xx_and_conforming_responses(case: Any, served: str) -> None:
    """Every generated request, valid or not, gets a documented non-5xx answer whose body
    matches the document. Three bodies in four name the served model, so that generation runs
    rather than every request ending in a 404."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("model"), str) and len(body["model"]) % 4:
        body["model"] = "default"
    case.call_and_validate(
        base_url=served, headers={"Authorization": f"Bearer {KEY}"}, checks=_CHECKS
    )


def test_the_document_describes_every_route(served: str) -> None:
    """/openapi.json is open (no key), is the generated document, and lists every public route
    and the error schema; the admin routes appear only when they exist."""
    r = requests.get(f"{served}/openapi.json", timeout=10)
    assert r.status_code == 200
    document = r.json()
    assert document == json.loads(
        json.dumps(openapi_document(admin=False, version=document["info"]["version"]))
    )
    assert set(document["paths"]) >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/input_items",
        "/v1/models",
        "/v1/models/{model}",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
    }
    assert "/admin/faults" not in document["paths"]
    assert "/admin/faults" in openapi_document(admin=True, version="x")["paths"]
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False and "messages" in chat["required"]
