"""BrowserTransform without a browser: the missing-dependency error, the checks on each call,
and the actions against a stand-in for playwright's async API (the objects and methods the
transform uses: async_playwright().start(), chromium.launch, new_context, route, new_page,
goto, click, fill, evaluate, wait_for_selector, the element readers, close, stop)."""

from __future__ import annotations

import asyncio
import json
import sys
import types

import pytest
from tensordict import TensorDict

from rlpost.data import ChatHistory, History
from rlpost.envs.browser import BROWSER_SCHEMA, BrowserTransform, BrowserUnavailable, action_problem, url_problem
from rlpost.envs.chat import ChatEnv
from rlpost.envs.tool_transforms import ToolCall

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------------ a stand-in for playwright


class FakeElement:
    async def text_content(self):
        return "Hello"

    async def inner_html(self):
        return "<b>Hello</b>"

    async def get_attribute(self, name):
        return f"value of {name}"


class FakePage:
    def __init__(self, context, world):
        self.context, self.world, self.url = context, world, "about:blank"

    async def goto(self, url, wait_until=None):
        self.world.log.append(("goto", id(self), url, wait_until))
        if "slow" in url:
            await asyncio.sleep(5)
        self.url = url
        return types.SimpleNamespace(status=200)

    async def click(self, selector):
        if selector == "#missing":
            raise RuntimeError("Timeout 30000ms exceeded waiting for #missing")
        self.world.log.append(("click", id(self), selector))

    async def fill(self, selector, text):
        self.world.log.append(("fill", id(self), selector, text))

    async def evaluate(self, script, arg=None):
        self.world.log.append(("evaluate", script, arg))

    async def wait_for_selector(self, selector):
        return None if selector == "#none" else FakeElement()


class FakeContext:
    def __init__(self, world):
        self.world, self.routes, self.closed = world, [], False

    async def route(self, pattern, handler):
        self.routes.append((pattern, handler))

    async def new_page(self):
        return FakePage(self, self.world)

    async def close(self):
        self.closed = True


class FakeWorld:
    """What the stand-in saw: the calls, the contexts, whether the browser closed."""

    def __init__(self, fail_launch=False):
        self.log, self.contexts, self.fail_launch = [], [], fail_launch
        self.launched = self.browser_closed = self.stopped = False

    def module(self):
        world = self

        class Browser:
            async def new_context(self):
                world.contexts.append(FakeContext(world))
                return world.contexts[-1]

            async def close(self):
                world.browser_closed = True

        class Chromium:
            async def launch(self, headless=True):
                if world.fail_launch:
                    raise RuntimeError("Executable doesn't exist at /ms-playwright/chromium")
                world.launched = headless
                return Browser()

        class Driver:
            chromium = Chromium()

            async def stop(self):
                world.stopped = True

        async def start():
            return Driver()

        api = types.ModuleType("playwright.async_api")
        api.async_playwright = lambda: types.SimpleNamespace(start=start)
        return api


@pytest.fixture
def world(monkeypatch):
    world = FakeWorld()
    package = types.ModuleType("playwright")
    package.async_api = world.module()
    monkeypatch.setitem(sys.modules, "playwright", package)
    monkeypatch.setitem(sys.modules, "playwright.async_api", package.async_api)
    return world


def call(**args):
    return f"<tool>browser\n{json.dumps(args)}</tool>"


def step(env, td, replies):
    prompt = td["history"].prompt
    k = prompt.batch_size[0]
    full = prompt.append(History(role=["assistant"] * k, content=replies, batch_size=[k]), inplace=False)
    td.set("history", ChatHistory(prompt=prompt, full=full, batch_size=[k]))
    return env.step(td)


def results(stepped):
    return [chat[-1]["content"] for chat in stepped["next", "history"].prompt.to_chats()]


# ------------------------------------------------------------------------------ without playwright


def test_missing_playwright_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "playwright", None)
    monkeypatch.setitem(sys.modules, "playwright.async_api", None)
    with pytest.raises(ImportError, match=r"pip install playwright && playwright install chromium"):
        BrowserTransform()


def test_urls_open_only_over_http_and_on_allowed_hosts():
    allowed = ["example.com"]
    assert url_problem("https://example.com/a", allowed) is None
    assert url_problem("https://docs.example.com:8443/a", allowed) is None
    assert url_problem("https://evilexample.com/", allowed) == (
        "Domain not allowed: evilexample.com. Must be one of: ['example.com']"
    )  # TorchRL's suffix test lets this one through
    assert url_problem("https://example.com@evil.org/", allowed).startswith("Domain not allowed: evil.org")
    assert url_problem("file:///etc/passwd", None) == "only http and https URLs may be opened, got 'file:///etc/passwd'"
    assert url_problem("https:///nohost", None) == "no host in URL 'https:///nohost'"
    assert url_problem("http://anything.org", None) is None


def test_each_call_is_checked_before_the_browser_is_touched():
    assert action_problem({"action": "screenshot"}, None) == (
        "Unknown action: 'screenshot' (actions: ['navigate', 'click', 'type', 'scroll', 'extract'])"
    )
    assert action_problem({"action": "type", "selector": "#q"}, None) == "action 'type' needs ['text']"
    assert action_problem({"action": "extract", "selector": "a", "extract_type": "attribute"}, None) == (
        "action 'extract' needs ['attribute']"
    )
    assert action_problem({"action": "extract", "selector": "a", "extract_type": "pdf"}, None).startswith(
        "extract_type must be one of ['text', 'html', 'attribute']"
    )
    assert action_problem({"action": "scroll", "scroll_amount": "0); fetch('//evil')"}, None) == (
        "scroll_amount must be an integer, got \"0); fetch('//evil')\""
    )
    assert action_problem({"action": "scroll", "scroll_amount": True}, None).startswith("scroll_amount must be")
    assert action_problem({"action": "click", "selector": 3}, None) == "['selector'] must be strings"
    assert action_problem({"action": "navigate", "url": "https://x.org"}, ["example.com"]).startswith(
        "Domain not allowed"
    )
    assert action_problem({"action": "scroll", "scroll_amount": -200}, None) is None
    assert BROWSER_SCHEMA["parameters"]["properties"]["action"]["enum"] == [
        "navigate",
        "click",
        "type",
        "scroll",
        "extract",
    ]


# ------------------------------------------------------------------------------ with the stand-in


def test_calls_parse_as_torchrls_tool_blocks(world):
    tool = BrowserTransform()
    text = "Opening.\n" + call(action="navigate", url="https://example.com") + "<tool>browser\nnot json</tool>"
    good, bad = tool.find_calls(text)
    assert good == ToolCall("browser", {"action": "navigate", "url": "https://example.com"})
    assert bad.error.startswith("Failed to parse tool arguments")
    assert tool.tool_schemas == {"browser": BROWSER_SCHEMA} and tool.timeout == 30.0 and tool.tool_role == "tool"


def test_each_episode_browses_its_own_page(world):
    tool = BrowserTransform(allowed_domains=["example.com"], timeout=2.0)
    env = ChatEnv(batch_size=[2], max_steps=3).append_transform(tool)
    td = env.reset(TensorDict({"query": ["a", "b"]}, batch_size=[2]))
    stepped = step(env, td, [call(action="navigate", url="https://example.com/a"),
                             call(action="navigate", url="https://docs.example.com/b")])  # fmt: skip
    assert results(stepped) == [
        'Tool browser executed successfully:\n{"url": "https://example.com/a", "status": 200}',
        'Tool browser executed successfully:\n{"url": "https://docs.example.com/b", "status": 200}',
    ]
    assert world.launched is True and len(world.contexts) == 2 and len(tool.pages) == 2
    pages = [id(tool.pages[e]) for e in td["browser_episode"].tolist()]
    assert [entry[1] for entry in world.log] == pages and world.log[0][3] == "networkidle"

    stepped = step(env, stepped["next"], [
        call(action="type", selector="#q", text="rl") + call(action="click", selector="#go")
        + call(action="scroll", scroll_amount=300),
        call(action="extract", selector="h1", extract_type="text") + call(action="click", selector="#missing")
        + call(action="navigate", url="https://evilexample.com/") + "<tool>shell\n{}</tool>",
    ])  # fmt: skip
    first, second = results(stepped)
    assert first == (
        'Tool browser executed successfully:\n{"typed": "rl", "into": "#q"}\n'
        'Tool browser executed successfully:\n{"clicked": "#go"}\n'
        'Tool browser executed successfully:\n{"scrolled": 300}'
    )
    assert second == (
        'Tool browser executed successfully:\n{"content": "Hello", "type": "text"}\n'
        "Tool browser failed:\nRuntimeError: Timeout 30000ms exceeded waiting for #missing\n"
        "Tool browser failed:\nDomain not allowed: evilexample.com. Must be one of: ['example.com']\n"
        "Tool shell failed:\nTool shell not found (known: ['browser'])"
    )
    assert ("evaluate", "(dy) => window.scrollBy(0, dy)", 300) in world.log  # the amount is an argument
    assert stepped["next", "tool_errors"].view(-1).tolist() == [0, 3]

    # every request a page makes is filtered to the allowed hosts
    pattern, handler = world.contexts[0].routes[0]
    verdicts = []

    class Route:
        def __init__(self, url):
            self.request = types.SimpleNamespace(url=url)

        async def continue_(self):
            verdicts.append(("continue", self.request.url))

        async def abort(self):
            verdicts.append(("abort", self.request.url))

    for url in ("https://cdn.example.com/app.js", "https://tracker.org/pixel"):
        asyncio.run(handler(Route(url)))
    assert pattern == "**/*" and verdicts == [
        ("continue", "https://cdn.example.com/app.js"),
        ("abort", "https://tracker.org/pixel"),
    ]

    step(env, stepped["next"], ["done", "done"])  # max_steps: both episodes end, their pages close
    assert tool.pages == {} and all(context.closed for context in world.contexts)
    tool.close()
    assert world.browser_closed and world.stopped


def test_extract_variants_timeouts_and_truncation(world):
    tool = BrowserTransform(timeout=0.5, max_result_chars=20)
    env = ChatEnv(batch_size=[1], max_steps=4).append_transform(tool)
    td = env.reset(TensorDict({"query": ["a"]}, batch_size=[1]))
    stepped = step(env, td, [
        call(action="extract", selector="a", extract_type="attribute", attribute="href")
        + call(action="extract", selector="#none", extract_type="html")
        + call(action="navigate", url="https://slow.org/")
    ])  # fmt: skip
    assert results(stepped) == [
        'Tool browser executed successfully:\n{"content": "value o\n[result truncated: more than 20 characters]\n'
        "Tool browser failed:\nLookupError: Element not found: #none\n"
        "Tool browser failed:\nbrowser action timed out after 0.5s"
    ]
    tool.close()


def test_a_browser_that_cannot_launch_raises_instead_of_answering_the_model(world):
    world.fail_launch = True
    env = ChatEnv(batch_size=[1]).append_transform(BrowserTransform())
    td = env.reset(TensorDict({"query": ["a"]}, batch_size=[1]))
    with pytest.raises(BrowserUnavailable, match="could not launch Chromium .*playwright install chromium"):
        step(env, td, [call(action="navigate", url="https://example.com")])


def test_clone_keeps_the_options(world):
    tool = BrowserTransform(["example.com"], headless=False, timeout=5.0, tokenizer="tok", tool_name="user")
    copy = tool.clone()
    assert (copy.allowed_domains, copy.headless, copy.timeout, copy.tokenizer, copy.tool_role) == (
        ["example.com"], False, 5.0, "tok", "user",
    )  # fmt: skip
