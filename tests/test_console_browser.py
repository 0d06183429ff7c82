"""The web console in headless Chromium against fake workers: model output with markup
is shown as text and safe links, and under --api-key the page asks for the key and
sends it as a bearer header. (The checks against a real stack are in
tests/test_e2e_pd.py; the helpers and how to install Chromium in tests/console_browser.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from console_browser import answered, by, errors, open_page, send, until
from fake_workers import FakeWorker, Served

from pdserve.router.app import RouterConfig, create_app

HOSTILE = (
    'Hi <script>window.__pwned = 1</script> <img src=x onerror="window.__pwned = 2">\n'
    "[safe](https://example.com/a?b=1) [bad](javascript:window.__pwned=3) "
    "[data](data:text/html,<b>x</b>) see http://example.org/x.\n"
    "```html\n<script>window.__pwned = 4</script>\n```\n"
)
KEY = "browser-key"


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[FakeWorker, FakeWorker]]:
    p, d = FakeWorker("prefill", "P").start(), FakeWorker("decode", "D")
    d.chat_text = HOSTILE
    d.start()
    yield p, d
    p.stop()
    d.stop()


def router(workers: tuple[FakeWorker, FakeWorker], api_key: str | None = None) -> Served:
    p, d = workers
    cfg = RouterConfig(prefill=((p.url, 9001),), decode=(d.url,), api_key=api_key)
    return Served(create_app(cfg))


def test_model_markup_is_shown_as_text(console_driver, workers):
    r = router(workers)
    try:
        open_page(console_driver, r.url)
        send(console_driver, "say something nasty", 32)
        assert answered(console_driver)["content"] == HOSTILE
    finally:
        r.stop()
    msg = console_driver.find_elements(by("CSS_SELECTOR"), ".msg.assistant .body")[-1]
    # built from text nodes: no element came from the model's markup
    assert msg.find_elements(by("CSS_SELECTOR"), "script, img, b, iframe") == []
    assert console_driver.execute_script("return window.__pwned") is None
    text = msg.text
    assert "<script>window.__pwned = 1</script>" in text and 'onerror="window' in text
    links = {a.text: a.get_attribute("href") for a in msg.find_elements(by("TAG_NAME"), "a")}
    assert links == {
        "safe": "https://example.com/a?b=1",
        "http://example.org/x": "http://example.org/x",
    }
    for a in msg.find_elements(by("TAG_NAME"), "a"):
        assert a.get_attribute("rel") == "noopener noreferrer nofollow"
    assert "[bad](javascript:window.__pwned=3)" in text and "[data](data:text/html," in text
    code = msg.find_element(by("CSS_SELECTOR"), "pre code").text
    assert code == "<script>window.__pwned = 4</script>"
    assert errors(console_driver) == []


def test_the_page_asks_for_the_key_and_sends_it_as_a_bearer_header(console_driver, workers):
    r = router(workers, api_key=KEY)
    try:
        console_driver.get("about:blank")
        console_driver.get_log("browser")  # drop an earlier page's messages
        console_driver.get(r.url + "/#live")
        dialog = console_driver.find_element(by("ID"), "key-dialog")
        until(console_driver, lambda d: dialog.get_attribute("open") is not None, "the key dialog")
        console_driver.find_element(by("ID"), "key-input").send_keys(KEY)
        console_driver.find_element(by("ID"), "key-ok").click()
        # /console/state answers only with the key: the live view filling proves it was sent
        until(console_driver, lambda d: len(d.find_elements(by("CSS_SELECTOR"), ".worker")) == 2,
              "the live view with the key")  # fmt: skip
        assert KEY not in console_driver.current_url
        assert console_driver.execute_script("return performance.getEntriesByType('resource')"
                                             ".every(e => !e.name.includes(arguments[0]))", KEY)  # fmt: skip
        assert errors(console_driver) == []
    finally:
        console_driver.execute_script("sessionStorage.clear()")
        r.stop()


def test_a_refused_request_shows_the_servers_message(console_driver, workers):
    _, d = workers
    r = router(workers)
    d.fail_status = 400
    try:
        open_page(console_driver, r.url)
        send(console_driver, "hello", 8)
        answered(console_driver, "error")
        shown = console_driver.find_element(by("ID"), "chat-error").text
        assert shown == "400: D failed", shown
    finally:
        d.fail_status = None
        r.stop()
    # the browser logs the 400 response itself; nothing else went wrong
    assert [e for e in errors(console_driver) if "status of 400" not in e["message"]] == []
