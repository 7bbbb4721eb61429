"""``stoic serve --replicas N`` where Ray Serve is not installed (what ``make serve`` installs):
a clear exit 2 naming the extra, before any work, not a traceback."""

from __future__ import annotations

import sys

import pytest
import structlog

from stoic.cli import build_parser, config_from_args, http_options
from stoic.ray._cli import serve_replicas


@pytest.mark.parametrize("missing", ["ray", "ray.serve"])
async def test_replicas_without_ray_serve_exit_2_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    # None in sys.modules makes `import` raise ModuleNotFoundError, as on a lean install
    # ("ray": no Ray at all; "ray.serve": Ray without its Serve dependencies)
    monkeypatch.setitem(sys.modules, missing, None)
    args = build_parser().parse_args(["serve", "--replicas", "2"])
    access, limits = http_options(args)
    with structlog.testing.capture_logs() as logs:
        status = await serve_replicas(args, config_from_args(args), access, limits)
    assert status == 2
    [event] = [e for e in logs if e["event"] == "stoic.start_failed"]
    assert event["error"] == "ImportError"
    assert f"{sys.executable} -m pip install -e '.[ray]'" in event["message"]
