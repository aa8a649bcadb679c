# server.py's chat page in a real headless browser (Debian's Chromium driven by the `playwright` package): type a
# message, press Send, watch the reply stream in; the page keeps the conversation for the next turn.
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
            reply = page.eval_on_selector(".assistant", "e => e.textContent")
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
            second = page.evaluate("document.querySelectorAll('.assistant')[1].textContent")
            messages += [{"role": "assistant", "content": want}, {"role": "user", "content": "And the sky?"}]
            want2 = server.client.chat.completions.create(model=server.model, messages=messages, temperature=0,
                                                          max_tokens=60).choices[0].message.content
            assert second == want2
            assert [e.inner_text() for e in page.query_selector_all(".user")] == ["Tell me about the sea",
                                                                                  "And the sky?"]
        finally:
            browser.close()
