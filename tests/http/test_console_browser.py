"""The operator's console in a real browser: Debian's headless Chromium, driven by Selenium,
against a live ``stoic serve`` (the tiny model, a worker process, fault injection, an admin key
and an API key). Nothing is downloaded: the browser and its driver are the system's
(``make install`` installs them with apt where it can); without them these tests skip.

Numbers appear and move while requests run; a ``kill -9`` of the worker shows "recovering",
then the new pid; a fault button arms a fault the next request meets; a missing, wrong or API
key gets no data; the page fits a phone's width with readable contrast.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

CHROMIUM = os.environ.get("STOIC_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("STOIC_CHROMEDRIVER", "/usr/bin/chromedriver")
ADMIN, USER = "console-admin-key", "console-user-key"


class _Log:
    """The server's log events seen so far, by name."""

    def __init__(self) -> None:
        self._events: list[str] = []

    def add(self, line: str) -> None:
        with contextlib.suppress(ValueError):  # progress bars and other lines that are not JSON
            self._events.append(str(json.loads(line).get("event")))

    def count(self, event: str) -> int:
        return self._events.count(event)


LOG = _Log()

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.ui import WebDriverWait

    _missing = next(
        (
            f"{path} is not installed (`apt-get install chromium chromium-driver`, or "
            "`make install` as root)"
            for path in (CHROMIUM, CHROMEDRIVER)
            if not (Path(path).is_file() and os.access(path, os.X_OK))
        ),
        None,
    )
except ImportError:  # pragma: no cover
    _missing = "selenium is not installed (the dev extra: pip install -e '.[dev]')"

pytestmark = pytest.mark.skipif(_missing is not None, reason=f"no browser: {_missing}")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[str]:
    """``stoic serve`` in a process of its own; yields its URL."""
    command = [sys.executable, "-m", "stoic", "serve", "--port", "0", "--log-format", "json"]
    command += ["--model", str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "256"]
    command += ["--executor", "process", "--enable-fault-injection", "--max-restarts", "100"]
    command += ["--admin-key", ADMIN, "--api-key", USER]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    found: dict[str, str] = {}
    ready = threading.Event()

    def read_log() -> None:  # keeps reading, so the server never blocks on a full pipe
        assert proc.stderr is not None
        for line in proc.stderr:
            LOG.add(line)
            if '"http.serving"' in line:
                found["url"] = json.loads(line)["url"]
                ready.set()
        ready.set()

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        assert ready.wait(180) and "url" in found, "the server did not start"
        yield found["url"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(10)
        assert proc.stderr is not None
        proc.stderr.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    options.add_argument("--window-size=1280,1000")
    # the driver's path given: Selenium Manager (which would download one) never runs
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _open(browser: WebDriver, url: str, key: str | None) -> None:
    """Open the console in a fresh state (no key remembered), with ``key`` typed in."""
    browser.get(f"{url}/console")
    browser.execute_script("sessionStorage.clear()")
    browser.get(f"{url}/console")
    if key is not None:
        browser.find_element(By.ID, "key").send_keys(key)
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()


def _text(browser: WebDriver, element_id: str) -> str:
    return str(browser.find_element(By.ID, element_id).text)


def _wait(browser: WebDriver, check: Callable[[], Any], limit: float, what: str) -> Any:
    return WebDriverWait(browser, limit, poll_frequency=0.1).until(
        lambda _: check(), message=f"{what}: not within {limit}s"
    )


def _number(browser: WebDriver, element_id: str) -> int | None:
    text = _text(browser, element_id)
    return int(text) if text.isdigit() else None


def _complete(url: str, max_tokens: int, prompt: str = "Once upon a time") -> requests.Response:
    return requests.post(
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {USER}"},
        json={"model": "default", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
        timeout=120,
    )


def _in_background(fn: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_numbers_appear_and_move_while_requests_run(server: str, browser: WebDriver) -> None:
    """With the admin key the page shows the executor serving in a worker process (a pid), and
    while requests run: their rows with tokens so far / max, tokens generated and steps that
    grow, and a tokens-per-second reading."""
    _open(browser, server, ADMIN)
    _wait(browser, lambda: _text(browser, "state") == "SERVING", 30, "serving")
    _wait(browser, lambda: _number(browser, "pid"), 10, "a pid")
    before = _number(browser, "generated") or 0
    load = [
        _in_background(lambda i=i: _complete(server, 400, f"Story {i}: once upon a time"))
        for i in range(3)
    ]
    row = re.compile(r"running (\d+) / 400")
    _wait(browser, lambda: row.search(_text(browser, "sequences")), 30, "a running row")
    seen = _wait(browser, lambda: (_number(browser, "generated") or 0) > before, 30, "tokens")
    assert seen
    first = _number(browser, "generated") or 0
    _wait(browser, lambda: (_number(browser, "generated") or 0) > first, 30, "tokens moving")
    _wait(browser, lambda: _text(browser, "now-tps") not in ("—", "0.0", "None"), 10, "tokens/s")
    assert _number(browser, "steps")
    for thread in load:
        thread.join(120)
    _wait(browser, lambda: "no sequence" in _text(browser, "sequences"), 30, "the rows leave")
    assert "p50" in _text(browser, "now-ttft")  # the requests' first tokens made a percentile


def test_kill_9_of_the_worker_shows_recovering_then_the_new_pid(
    server: str, browser: WebDriver
) -> None:
    """SIGKILL of the worker while a request runs: the page says RECOVERING (if the recovery
    outlasts its one-second sampling), then SERVING with another pid and one more restart (of
    kind crash), and an incident row for it."""
    _open(browser, server, ADMIN)
    _wait(browser, lambda: _text(browser, "state") == "SERVING", 30, "serving")
    pid = _wait(browser, lambda: _number(browser, "pid"), 10, "a pid")
    restarts = _number(browser, "restarts") or 0
    _in_background(lambda: _complete(server, 480))
    _wait(browser, lambda: "running" in _text(browser, "sequences"), 30, "a running request")
    os.kill(pid, signal.SIGKILL)
    # RECOVERING is on the page for as long as the recovery lasts, sampled once a second: with
    # the KV cache kept and a pre-started interpreter a tiny model's can end between two
    # samples, so the page may go straight to one more restart (the incident row says it all)
    _wait(
        browser,
        lambda: (
            _text(browser, "state") == "RECOVERING" or _number(browser, "restarts") == restarts + 1
        ),
        20,
        "recovering shown, or the restart counted",
    )
    _wait(browser, lambda: _text(browser, "state") == "SERVING", 120, "serving again")
    new_pid = _wait(browser, lambda: _number(browser, "pid"), 10, "the new pid")
    assert new_pid != pid
    assert _number(browser, "restarts") == restarts + 1
    assert "crash" in _text(browser, "restarts-by-kind")
    incidents = _text(browser, "incidents")
    assert "crash" in incidents and "RECOVERED" in incidents and "SIGKILL" in incidents


def test_a_fault_button_arms_a_fault_the_next_request_meets(
    server: str, browser: WebDriver
) -> None:
    """Arm error after 1 step with the page's button (through POST /admin/faults with the
    admin key): the next request fails with the injected error, and the page counts it and
    lists the incident."""
    _open(browser, server, ADMIN)
    _wait(browser, lambda: _text(browser, "state") == "SERVING", 60, "serving")
    injected = _wait(browser, lambda: _number(browser, "faults-injected") is not None, 10, "n")
    injected = _number(browser, "faults-injected")
    browser.find_element(By.CSS_SELECTOR, '#fault-buttons button[data-kind="error"]').click()
    _wait(browser, lambda: "armed error" in _text(browser, "fault-result"), 10, "armed")
    answer = _complete(server, 16)
    assert answer.status_code == 500
    assert "injected fault" in answer.json()["error"]["message"]
    _wait(browser, lambda: _number(browser, "faults-injected") == injected + 1, 10, "counted")
    _wait(browser, lambda: "injected fault" in _text(browser, "incidents"), 30, "the incident")
    browser.find_element(By.ID, "clear-faults").click()
    _wait(browser, lambda: "cleared" in _text(browser, "fault-result"), 10, "cleared")


@pytest.mark.parametrize(
    ("key", "status"),
    [(None, 401), ("not-the-key", 401), (USER, 403)],
    ids=["none", "wrong", "api"],
)
def test_a_missing_or_wrong_admin_key_gets_no_data(
    server: str, browser: WebDriver, key: str | None, status: int
) -> None:
    """Without the admin key (none, a wrong one, or an API key) the page says it is not
    authorised and shows no number: the stream refused it."""
    _open(browser, server, key)
    _wait(browser, lambda: f"not authorised ({status})" in _text(browser, "connection"), 20, "no")
    assert _text(browser, "pid") == "—" and _text(browser, "generated") == "—"
    assert _text(browser, "state") == "UNKNOWN"
    assert not browser.find_element(By.ID, "faults-section").is_displayed()


_CONTRAST = """
function lum(c) {
  const [r, g, b] = c.match(/[\\d.]+/g).slice(0, 3).map(Number).map((v) => {
    v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); });
  return 0.2126 * r + 0.7152 * g + 0.0722 * b;
}
function bg(el) {
  for (; el; el = el.parentElement) {
    const c = getComputedStyle(el).backgroundColor;
    if (c && !c.startsWith("rgba(0, 0, 0, 0)") && c !== "transparent") return c;
  }
  return "rgb(255, 255, 255)";
}
return [...document.querySelectorAll(arguments[0])].filter((el) => el.offsetParent).map((el) => {
  const a = lum(getComputedStyle(el).color), b = lum(bg(el));
  return [el.id || el.tagName, (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)];
});
"""


def test_the_page_fits_a_phone_and_its_text_has_contrast(server: str, browser: WebDriver) -> None:
    """At a phone's width (390 px) nothing scrolls sideways but the tables' own boxes; every
    text shown (state words on their colour included) has a contrast of 4.5:1 or more."""
    phone = {"width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": True}
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", phone)
    try:
        _open(browser, server, ADMIN)
        _wait(browser, lambda: _text(browser, "state") == "SERVING", 60, "serving")
        width = browser.execute_script("return document.documentElement.clientWidth")
        assert width == 390
        assert browser.execute_script("return document.documentElement.scrollWidth") <= width
        shown = "h1, h2, dt, dd, th, td, p, label, button, .state"
        ratios = browser.execute_script(_CONTRAST, shown)
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    assert ratios
    low = [(name, round(r, 2)) for name, r in ratios if r < 4.5]
    assert not low, f"text below 4.5:1 contrast: {low}"


def test_the_page_loads_only_its_own_files_and_closing_it_ends_the_stream(
    server: str, browser: WebDriver
) -> None:
    """Everything the page loads comes from the server (no CDN); leaving it (the tab closed)
    ends its stream on the server, which logs ``console.closed``."""
    _open(browser, server, ADMIN)
    _wait(browser, lambda: _text(browser, "state") == "SERVING", 60, "serving")
    names = browser.execute_script(
        "return performance.getEntriesByType('resource').map((e) => e.name)"
    )
    assert names and all(n.startswith(server) for n in names), names
    closed = LOG.count("console.closed")
    browser.get("about:blank")
    _wait(browser, lambda: LOG.count("console.closed") > closed, 10, "the stream closed")
