"""The ``stoic`` command's entry point: SIGINT/SIGTERM are quiet (exit 0, nothing printed) from
before anything heavy is imported, ``import stoic`` imports nothing, and every public name of
``stoic`` is still there at first use."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import stoic

ROOT = Path(__file__).resolve().parent.parent
#: what a Ctrl-C must not interrupt with a traceback: the CLI's imports and torch's
HEAVY = ("torch", "transformers", "aiohttp", "pydantic", "structlog", "numpy", "asyncio")


def _sigint_default() -> None:
    """In the child before exec: SIGINT at its default, whatever this process inherited (a
    shell's background job starts with SIGINT ignored, and a Python started so installs no
    handler of its own: the tests would see the shell's choice, not stoic's)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
        preexec_fn=_sigint_default,
    )


def test_the_console_script_is_the_quiet_entry_point() -> None:
    """``stoic`` (the installed command) runs :func:`stoic._entry.main`, not the CLI module
    (whose imports come before its own handlers)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["stoic"] == "stoic._entry:main"


def test_importing_stoic_and_the_entry_point_imports_nothing_heavy() -> None:
    """``import stoic`` and the entry module load no heavy dependency: the window before the
    command's signal handlers is Python's own start-up alone."""
    done = _python(
        f"""
        import sys
        import stoic._entry
        print(sorted(m for m in {HEAVY!r} if m in sys.modules))
        print(sorted(m for m in sys.modules if m.startswith("stoic")))
        """
    )
    assert done.returncode == 0, done.stderr
    heavy, ours = done.stdout.splitlines()
    assert heavy == "[]"
    assert ours == "['stoic', 'stoic._entry']"


def test_every_public_name_imports_at_first_use() -> None:
    """``from stoic import X`` works for each public name (in a fresh interpreter, where none
    is imported yet), gives the defining module's object, and ``dir(stoic)`` lists it."""
    lines = [f"from stoic import {name} as v{i}" for i, name in enumerate(stoic.__all__)]
    done = _python(
        "\n".join(lines)
        + f"""
import stoic
for i, name in enumerate({stoic.__all__!r}):
    value = globals()[f"v{{i}}"]
    assert getattr(stoic, name) is value and name in dir(stoic), name
    home = getattr(value, "__module__", getattr(value, "__name__", ""))
    assert home.startswith("stoic."), (name, home)
print("ok")
"""
    )
    assert done.stdout == "ok\n", done.stderr


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        stoic.Engin  # noqa: B018


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_after_the_entry_point_exits_0_and_prints_nothing(
    signum: signal.Signals,
) -> None:
    """Once the entry point has run, a signal in the middle of an import (here: while the
    process is stopped inside one) ends the process at once with status 0, nothing printed."""
    done = _python(
        f"""
        import os, signal, time
        from stoic._entry import quiet_signals
        quiet_signals()
        os.kill(os.getpid(), {int(signum)})
        time.sleep(30)
        raise SystemExit(3)
        """
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_the_cli_restores_pythons_handlers_after_the_entry_point_quieted_them() -> None:
    """``stoic cache`` (and ``asyncio.run`` for ``serve``) get Python's own SIGINT handler
    back, not the entry point's: a Ctrl-C there is an interruption, not a success."""
    done = _python(
        """
        import signal
        from stoic._entry import exit_at_once, quiet_signals
        from stoic.cli._signals import exit_on_signals
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        quiet_signals()
        with exit_on_signals() as restore:
            assert signal.getsignal(signal.SIGINT) is exit_at_once
            restore(signal.SIGINT)
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            assert signal.getsignal(signal.SIGTERM) is exit_at_once
        assert {s: signal.getsignal(s) for s in before} == before
        print("ok")
        """
    )
    assert done.stdout == "ok\n", done.stderr
