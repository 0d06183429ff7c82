"""Driving the web console in a real headless Chromium (Debian's `chromium` and
`chromium-driver`, through selenium from PyPI). The checks against a real stack run in
tests/test_e2e_pd.py on its `pdserve up` (one stack for the suite's end-to-end tests);
tests/test_console_browser.py runs those that need only fake workers.

Without Chromium the `console_driver` fixture (tests/conftest.py) skips, saying how to
install it: `make browser`, or `apt-get install -y chromium chromium-driver`.

Screenshots go to a temporary folder, or to $PDSERVE_CONSOLE_SCREENSHOTS: the README's
docs/img/console-chat.png and docs/img/console-live.png come from
`PDSERVE_CONSOLE_SCREENSHOTS=docs/img pytest tests/test_e2e_pd.py -k console`.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

WAIT_S = 20.0  # the longest any step waits (a shared machine can be slow)
SKIP_WHY = (
    "no headless browser: the console's browser tests need Debian's chromium and "
    "chromium-driver (`make browser`, or apt-get install -y chromium chromium-driver) "
    "and selenium (the dev extra)"
)


def start_driver() -> Any:
    """A headless Chromium session; pytest.skip when Chromium or selenium is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    try:
        from selenium import webdriver
    except ImportError:
        pytest.skip(SKIP_WHY)
    if not (chromium and driver):
        pytest.skip(SKIP_WHY)
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,820", "--no-first-run", "--disable-extensions"):  # fmt: skip
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # an explicit driver: selenium downloads nothing
    d = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=driver))
    d.set_page_load_timeout(WAIT_S)
    d.set_script_timeout(WAIT_S)
    return d


def by(kind: str) -> str:
    from selenium.webdriver.common.by import By

    return str(getattr(By, kind))


def until(driver: Any, cond: Callable[[Any], Any], what: str) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, WAIT_S, poll_frequency=0.05)
    return wait.until(cond, message=f"waited {WAIT_S} s for {what}")


def errors(driver: Any) -> list[dict]:
    """The console's errors since the last call (its log is read once)."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def open_page(driver: Any, url: str) -> None:
    """Load the console afresh: what an earlier page logged (a live view polling a
    server since stopped) is read and dropped first."""
    driver.get("about:blank")
    driver.get_log("browser")
    driver.get(url + "/")
    until(driver, lambda d: d.execute_script("return !!window.pdconsole"), "the app")


def conversation(driver: Any) -> list[dict]:
    return list(driver.execute_script("return window.pdconsole.conversation()"))


def send(driver: Any, text: str, max_tokens: int) -> None:
    field = driver.find_element(by("ID"), "max-tokens")
    field.clear()
    field.send_keys(str(max_tokens))
    driver.find_element(by("ID"), "prompt").send_keys(text)
    driver.find_element(by("ID"), "send").click()


def answered(driver: Any, state: str = "done") -> dict:
    until(driver, lambda d: conversation(d)[-1]["state"] == state, f"an answer {state}")
    return conversation(driver)[-1]


def screenshot(driver: Any, path: Path) -> None:
    """Save the page as PNG and check it is not blank (a failed page is a colour or two;
    the console has text, bars and cards)."""
    from PIL import Image

    driver.save_screenshot(str(path))
    with Image.open(path) as im:
        colours = im.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 20, (path, len(colours or []))


# ---- against a real stack (tests/test_e2e_pd.py) ------------------------------------------
CHAT = "Name three colours."
SYSTEM = "You answer in one word."


def check_chat(driver: Any, url: str, shots: Path) -> None:
    open_page(driver, url)
    until(driver, lambda d: d.find_element(by("ID"), "model").text, "the model's name")
    send(driver, CHAT, 16)
    got = answered(driver)
    assert got["role"] == "assistant" and got["content"]
    body = {"messages": [{"role": "user", "content": CHAT}], "max_tokens": 16, "temperature": 0}
    api = httpx.post(url + "/v1/chat/completions", json=body, timeout=WAIT_S).json()
    assert got["content"] == api["choices"][0]["message"]["content"]
    stats = driver.find_element(by("CSS_SELECTOR"), ".msg.assistant .stats").text
    assert "TTFT" in stats and "TPOT" in stats and "16 tokens" in stats, stats
    screenshot(driver, shots / "console-chat.png")
    # Regenerate, now with a system prompt: the answer the API gives to both messages
    driver.find_element(by("ID"), "system").send_keys(SYSTEM)
    driver.find_element(by("ID"), "regenerate").click()
    again = answered(driver)
    body["messages"] = [{"role": "system", "content": SYSTEM}, *body["messages"]]
    api = httpx.post(url + "/v1/chat/completions", json=body, timeout=WAIT_S).json()
    assert again["content"] == api["choices"][0]["message"]["content"]
    assert [m["role"] for m in conversation(driver)] == ["user", "assistant"]
    assert errors(driver) == []


def check_stop(driver: Any, url: str) -> None:
    """Stop mid-stream: the text stops growing and Regenerate is offered (the caller
    checks that both workers freed the request)."""
    context = httpx.get(url + "/model_info", timeout=5).json()["max_context_length"]
    send(driver, "Tell me a long story.", context - 200)
    until(driver, lambda d: len(conversation(d)[-1]["content"]) > 20, "the answer to start")
    driver.find_element(by("ID"), "stop").click()
    got = answered(driver, "stopped")
    time.sleep(0.5)
    assert conversation(driver)[-1]["content"] == got["content"]  # nothing after Stop
    assert driver.execute_script("return window.pdconsole.busy()") is False
    assert not driver.find_element(by("ID"), "regenerate").get_attribute("disabled")
    assert errors(driver) == []


def _load(url: str, stop_at: threading.Event) -> None:
    """Short requests, four at a time, until `stop_at` is set."""

    def one(i: int) -> None:
        while not stop_at.is_set():
            body = {"prompt": f"load {i} " * 20, "max_tokens": 24, "temperature": 0}
            httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)


def worker_stat(driver: Any, role: str, key: str) -> str:
    """A value on a worker's card, read in one script (the view redraws every poll, so an
    element found in one call may be gone by the next)."""
    sel = f'.worker[data-role="{role}"] .stat[data-key="{key}"] .value'
    return str(
        driver.execute_script("return document.querySelector(arguments[0]).textContent", sel)
    )


def check_live(driver: Any, url: str, shots: Path) -> None:
    """Both workers shown; under a small load the counters and the stage bars move."""
    css = by("CSS_SELECTOR")
    driver.find_element(by("ID"), "tab-live").click()
    until(driver, lambda d: len(d.find_elements(css, ".worker")) == 2, "two worker cards")
    roles = set(driver.execute_script(
        "return [...document.querySelectorAll('.worker')].map(e => e.dataset.role)"
    ))  # fmt: skip
    assert roles == {"prefill", "decode"}
    before = int(worker_stat(driver, "decode", "finished"))
    kv_before = worker_stat(driver, "decode", "kv_bytes")
    stop_at = threading.Event()
    loader = threading.Thread(target=_load, args=(url, stop_at), daemon=True)
    loader.start()
    try:
        until(driver, lambda d: int(worker_stat(d, "decode", "finished")) >= before + 4,
              "the decode's finished count to move")  # fmt: skip
        until(driver, lambda d: worker_stat(d, "decode", "kv_bytes") != kv_before, "KV bytes")
        until(driver, lambda d: len(d.find_elements(css, "#recent tbody tr")) >= 4,
              "the last requests' stages")  # fmt: skip
        screenshot(driver, shots / "console-live.png")
    finally:
        stop_at.set()
        loader.join(WAIT_S)
    widths = driver.execute_script(
        "return [...document.querySelectorAll('#recent .seg.prefill')].map(e => e.style.width)"
    )
    assert any(w not in ("", "0%", "0.00%") for w in widths), widths
    assert errors(driver) == []
