# server.py's chat page in a real headless browser (Debian's Chromium driven by the `playwright` package): type a
# message, press Send, watch the reply stream in; the page keeps the conversation for the next turn, drops a failed
# turn from it, renders markdown without letting the model's text inject HTML, and fits a 400 px wide phone.
import os
import shutil
import subprocess

import pytest
from test_server import ServerProcess, make_checkpoint

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="session")
def chromium():
    """Debian's chromium; installed with apt-get when missing (CI runs as root on a fresh Debian image)."""
    if not os.path.exists(CHROMIUM):
        print(f"\n{CHROMIUM} is missing: apt-get install -y chromium (a few minutes) ...", flush=True)
        apt = shutil.which("apt-get")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        ok = apt and os.geteuid() == 0 and subprocess.run(f"{apt} update -qq && {apt} install -y -qq chromium",
                                                          shell=True, env=env).returncode == 0
        if not ok or not os.path.exists(CHROMIUM):
            pytest.fail(f"the chat page test needs Chromium at {CHROMIUM}: install it with "
                        "`apt-get install chromium` (as root; Debian's package)")
    return CHROMIUM


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = make_checkpoint(tmp_path_factory.mktemp("page") / "tiny-page")
    srv = ServerProcess("--checkpoint_path", d / "model.pth", "--full_batch_size", 2, "--max_seq_length", 1024,
                        "--threads", 1)
    yield srv
    srv.stop()


def test_chat_page_streams_a_reply_and_keeps_the_conversation(chromium, server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page()
            page.goto(server.url)
            page.wait_for_function("document.getElementById('model').textContent === 'tiny-page'")
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "60")
            # record every length the reply bubble goes through while it streams
            page.evaluate("""() => { window.lengths = [];
                new MutationObserver(() => { const a = document.querySelectorAll('.assistant');
                    if (a.length) window.lengths.push(a[a.length - 1].textContent.length); })
                .observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true}); }""")
            page.fill("#input", "Tell me about the sea")
            page.click("#send")
            page.wait_for_selector(".assistant")
            page.wait_for_function("!document.getElementById('send').disabled", timeout=60000)  # reply complete
            reply = page.eval_on_selector(".assistant", "e => e.dataset.raw")
            lengths = page.evaluate("window.lengths")
            assert reply and page.query_selector(".error") is None
            assert len(set(l for l in lengths if l > 0)) > 1 and lengths == sorted(lengths)  # it grew piece by piece
            messages = [{"role": "user", "content": "Tell me about the sea"}]
            want = server.client.chat.completions.create(model=server.model, messages=messages, temperature=0,
                                                         max_tokens=60).choices[0].message.content
            assert reply == want
            # the second turn sends the whole conversation
            page.fill("#input", "And the sky?")
            page.press("#input", "Enter")
            page.wait_for_function("document.querySelectorAll('.assistant').length === 2 && "
                                   "!document.getElementById('send').disabled", timeout=60000)
            second = page.evaluate("document.querySelectorAll('.assistant')[1].dataset.raw")
            messages += [{"role": "assistant", "content": want}, {"role": "user", "content": "And the sky?"}]
            want2 = server.client.chat.completions.create(model=server.model, messages=messages, temperature=0,
                                                          max_tokens=60).choices[0].message.content
            assert second == want2
            assert [e.inner_text() for e in page.query_selector_all(".user")] == ["Tell me about the sea",
                                                                                  "And the sky?"]
        finally:
            browser.close()


def test_chat_page_at_phone_width_markdown_and_a_failed_turn(chromium, server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 400, "height": 700})
            page.goto(server.url)
            page.wait_for_function("document.getElementById('model').textContent === 'tiny-page'")
            # everything in the header is on screen: nothing wider than the page
            assert page.evaluate("document.documentElement.scrollWidth") <= 400
            for sel in ("header", "#system", "#clear", "#send", "#stop", "#input"):
                box = page.locator(sel).bounding_box()
                assert box["x"] >= 0 and box["x"] + box["width"] <= 400, sel
            # markdown: code blocks and inline code; the model's own HTML stays text
            html = page.evaluate("markdown('Use `x`:\\n```python\\nprint(1 < 2)\\n```\\n<b>not bold</b> **bold**')")
            assert "<pre><code>print(1 &lt; 2)</code></pre>" in html and "<code>x</code>" in html
            assert "&lt;b&gt;not bold&lt;/b&gt;" in html and "<strong>bold</strong>" in html
            # a failed turn (max tokens 0: a 400) leaves the conversation; the next turn is sent without it
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "0")
            page.fill("#input", "This one fails")
            page.click("#send")
            page.wait_for_selector(".error")
            page.wait_for_function("!document.getElementById('send').disabled")
            assert "max_tokens" in page.inner_text(".error")
            page.fill("#max_tokens", "20")
            page.fill("#input", "Tell me about the sea")
            page.click("#send")
            page.wait_for_function("document.querySelectorAll('.assistant').length === 1 && "
                                   "!document.getElementById('send').disabled", timeout=60000)
            got = page.evaluate("document.querySelector('.assistant').dataset.raw")  # (the failed one: .error)
            want = server.client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": "Tell me about the sea"}], temperature=0,
                max_tokens=20).choices[0].message.content
            assert got == want
        finally:
            browser.close()
