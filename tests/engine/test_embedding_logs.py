"""stoic as a library is quiet: its structlog events go to stdlib ``logging`` under ``stoic``,
print nothing until the host configures logging, and never touch the root logger."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from stoic._logging import get_logger
from stoic.cli import configure_logging

# an application embedding stoic, as in the README; argv: model directory, file for the text,
# and "quiet" or "basicConfig"
SCRIPT = """
import asyncio, logging, sys
import stoic

async def main(model: str, out: str) -> None:
    config = stoic.EngineConfig(model=model, dtype="float32", num_kv_blocks=32)
    texts = []
    async with stoic.Engine.start(config) as engine:
        params = stoic.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        async for delta in engine.generate("Once upon a time", params):
            texts.append(delta.text)
            print(delta.text, end="", flush=True)
        print()
    with open(out, "w", encoding="utf-8") as f:
        f.write("".join(texts))

if sys.argv[3] == "basicConfig":
    logging.basicConfig(level=logging.INFO)
asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def _embed(model: Path, tmp_path: Path, mode: str) -> tuple[str, str, str]:
    """Run the embedding script: (stdout, stderr, the generated text)."""
    env = {k: v for k, v in os.environ.items() if "PROGRESS" not in k and k != "TQDM_DISABLE"}
    env["PYTHONIOENCODING"] = "utf-8"
    out = tmp_path / f"{mode}.txt"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model), str(out), mode],
        capture_output=True,
        env=env,
        timeout=300,
        check=False,
    )
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, stderr
    return stdout, stderr, out.read_text(encoding="utf-8")


def test_an_embedded_engine_prints_only_what_the_application_prints(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """No log line, progress bar or warning: stdout is the generated text, stderr is empty."""
    stdout, stderr, text = _embed(tiny_model_dir, tmp_path, "quiet")
    assert text
    assert stdout == text + "\n"
    assert stderr == ""


def test_a_host_that_configures_logging_sees_the_events(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``logging.basicConfig(level=logging.INFO)`` shows stoic's events, on the host's handler
    (stderr), as ``event key=value`` messages; stdout stays the application's."""
    stdout, stderr, text = _embed(tiny_model_dir, tmp_path, "basicConfig")
    assert stdout == text + "\n"
    lines = stderr.splitlines()
    assert any(line.startswith("INFO:stoic.model:model.load.done ") for line in lines), stderr
    assert any(line.startswith("INFO:stoic.engine:engine.started ") for line in lines), stderr
    assert any(
        line.startswith("INFO:stoic.runtime:actor.started ") and "actor=scheduler" in line
        for line in lines
    ), stderr
    assert "INFO:stoic.engine:engine.stopped" in lines


@pytest.fixture
def unconfigured() -> Iterator[None]:
    """structlog as an application that never configured it leaves it (restored afterwards)."""
    was_configured, config = structlog.is_configured(), structlog.get_config()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    structlog.reset_defaults()
    try:
        yield
    finally:
        root.handlers[:], root.level = handlers, level
        logging.captureWarnings(False)
        if was_configured:
            structlog.configure(**config)
        else:
            structlog.reset_defaults()


def _handler(logger: logging.Logger, formatter: logging.Formatter) -> io.StringIO:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger.addHandler(handler)
    return stream


@pytest.mark.usefixtures("unconfigured")
def test_library_loggers_are_stdlib_loggers_under_stoic() -> None:
    """Unconfigured: the ``stoic`` logger has only a NullHandler, an event is a stdlib record
    of ``stoic.<area>`` whose message reads ``event key=value``, below the level nothing runs,
    and an exception travels on the record."""
    assert [type(h) for h in logging.getLogger("stoic").handlers] == [logging.NullHandler]
    logger = logging.getLogger("stoic.testing")
    stream = _handler(logger, logging.Formatter("%(levelname)s %(name)s %(message)s"))
    logger.setLevel(logging.INFO)
    try:
        log = get_logger("stoic.testing").bind(actor="a b")
        log.debug("test.hidden", n=1)
        log.info("test.event", n=1, name="x")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("test.failed")
    finally:
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
    text = stream.getvalue()
    assert "test.hidden" not in text
    assert "INFO stoic.testing test.event actor='a b' n=1 name=x\n" in text
    assert "ERROR stoic.testing test.failed actor='a b'\nTraceback" in text
    assert "ValueError: boom" in text
    with pytest.raises(ValueError, match="not a stoic logger"):
        get_logger("elsewhere")


@pytest.mark.usefixtures("unconfigured")
def test_capture_logs_still_captures_library_events() -> None:
    """structlog's testing helper sees stoic's events, also of loggers bound before it."""
    log = get_logger("stoic.testing").bind(actor="w")
    with capture_logs() as logs:
        log.info("test.captured", n=2)
    assert logs == [{"event": "test.captured", "n": 2, "actor": "w", "log_level": "info"}]


@pytest.mark.usefixtures("unconfigured")
def test_configure_logging_renders_json_lines_with_the_request_id(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``stoic serve``'s configuration: one JSON object per line on stderr with level, logger,
    timestamp and bound context variables, for stoic's events and other libraries' records."""
    configure_logging("json", "info")
    log = get_logger("stoic.testing")
    with structlog.contextvars.bound_contextvars(request_id="r-1"):
        log.debug("test.hidden")
        log.info("test.json", n=3)
        logging.getLogger("aiohttp.access").warning("GET / %s", 200)
    captured = capsys.readouterr()
    assert captured.out == ""
    records: list[dict[str, Any]] = [json.loads(line) for line in captured.err.splitlines()]
    assert [r["event"] for r in records] == ["test.json", "GET / 200"]
    first, second = records
    assert first["n"] == 3 and first["level"] == "info" and first["logger"] == "stoic.testing"
    assert first["request_id"] == "r-1" and "timestamp" in first
    assert second["level"] == "warning" and second["logger"] == "aiohttp.access"
    assert second["request_id"] == "r-1"


def test_library_code_gets_its_loggers_from_stoic_logging() -> None:
    """A ``structlog.get_logger`` in stoic would print to stdout in an unconfigured host."""
    root = Path(__file__).resolve().parents[2] / "stoic"
    offenders = [
        str(path.relative_to(root))
        for path in sorted(root.rglob("*.py"))
        if "structlog.get_logger(" in path.read_text(encoding="utf-8")
    ]
    assert offenders == []


def _log_a_bug() -> None:
    secret_local = "LOCAL-VALUE-42"  # shown with the traceback at debug level only
    try:
        raise KeyError(secret_local[:5])
    except KeyError as exc:
        get_logger("stoic.testing").error("test.bug", exc_info=exc)


@pytest.mark.usefixtures("unconfigured")
@pytest.mark.parametrize("fmt", ["console", "json"])
@pytest.mark.parametrize("level", ["info", "debug"])
def test_a_traceback_shows_locals_only_at_debug_level(
    fmt: str, level: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``stoic serve``: a bug's traceback is logged in both formats, each frame's local
    variables only with ``--log-level debug`` (at info a console traceback is Python's own
    format, a few lines a frame)."""
    configure_logging(fmt, level)
    _log_a_bug()
    err = capsys.readouterr().err
    assert "test.bug" in err and "_log_a_bug" in err
    assert ("LOCAL-VALUE-42" in err) == (level == "debug")
    if fmt == "json":
        (record,) = [json.loads(line) for line in err.splitlines()]
        frames = record["exception"][0]["frames"]
        assert all(("locals" in frame) == (level == "debug") for frame in frames)
    elif level == "info":
        assert "Traceback (most recent call last):" in err
        assert len(err.splitlines()) < 12
