"""A web browser as a tool: TorchRL's ``BrowserTransform``, driven through playwright.

The model calls one tool, ``browser``, in TorchRL's ``<tool>`` blocks::

    <tool>browser
    {"action": "navigate", "url": "https://pytorch.org"}
    </tool>

with the actions of :data:`BROWSER_SCHEMA`. Needs ``pip install playwright`` and
``playwright install chromium`` (imported when the transform is built).
"""

from __future__ import annotations

import itertools
import json
from typing import Any
from urllib.parse import urlsplit

import torch
from tensordict import TensorDictBase

from rlpost.envs.event_loop import EventLoopThread
from rlpost.envs.tool_transforms import SimpleToolTransform, ToolCall

ACTIONS = ("navigate", "click", "type", "scroll", "extract")
EXTRACT_TYPES = ("text", "html", "attribute")
_REQUIRED = {"navigate": ("url",), "click": ("selector",), "type": ("selector", "text"),
             "scroll": ("scroll_amount",), "extract": ("selector", "extract_type")}  # fmt: skip
_STRING_ARGS = ("url", "selector", "text", "attribute")
INSTALL_HINT = "pip install playwright && playwright install chromium"

BROWSER_SCHEMA = {
    "name": "browser",
    "description": "Browse and interact with web pages",
    "parameters": {
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": list(ACTIONS), "description": "What to do"},
            "url": {"type": "string", "description": "The page to open (navigate)"},
            "selector": {"type": "string", "description": "CSS selector of the element (click, type, extract)"},
            "text": {"type": "string", "description": "What to type (type)"},
            "scroll_amount": {"type": "integer", "description": "Pixels to scroll down, negative for up (scroll)"},
            "extract_type": {"type": "string", "enum": list(EXTRACT_TYPES), "description": "What to read (extract)"},
            "attribute": {"type": "string", "description": "Attribute to read (extract_type attribute)"},
        },
        "required": ["action"],
    },
}


class BrowserUnavailable(RuntimeError):
    """Chromium could not be launched: a fault of the host, raised instead of shown to the model."""


def url_problem(url: str, allowed_domains: list[str] | None) -> str | None:
    """Why the browser may not open ``url``, or None. Only http(s) URLs; with
    ``allowed_domains``, only those hosts and their subdomains."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return f"only http and https URLs may be opened, got {url!r}"
    host = (parts.hostname or "").lower()
    if not host:
        return f"no host in URL {url!r}"
    if allowed_domains and not any(host == d or host.endswith("." + d) for d in allowed_domains):
        return f"Domain not allowed: {host}. Must be one of: {allowed_domains}"
    return None


def action_problem(args: dict[str, Any], allowed_domains: list[str] | None) -> str | None:
    """Why the arguments of a ``browser`` call cannot be run, or None (checked before any page
    is touched, so a malformed call costs no browser time)."""
    action = args.get("action")
    if action not in ACTIONS:
        return f"Unknown action: {action!r} (actions: {list(ACTIONS)})"
    missing = [name for name in _REQUIRED[action] if name not in args]
    if action == "extract" and args.get("extract_type") == "attribute" and "attribute" not in args:
        missing.append("attribute")
    if missing:
        return f"action {action!r} needs {missing}"
    bad = [name for name in _STRING_ARGS if name in args and not isinstance(args[name], str)]
    if bad:
        return f"{bad} must be strings"
    amount = args.get("scroll_amount")
    if action == "scroll" and (isinstance(amount, bool) or not isinstance(amount, int)):
        return f"scroll_amount must be an integer, got {amount!r}"
    if action == "extract" and args["extract_type"] not in EXTRACT_TYPES:
        return f"extract_type must be one of {list(EXTRACT_TYPES)}, got {args['extract_type']!r}"
    return url_problem(args["url"], allowed_domains) if action == "navigate" else None


class BrowserTransform(SimpleToolTransform):
    """Let the model browse: each ``browser`` call runs one action on its episode's page.

    TorchRL's constructor (``timeout`` per action) plus ``max_result_chars`` (a longer result is
    cut, with a marker) and ``max_workers``. Chromium starts at the first action; ``close()``
    stops it.

    Deliberate deviations from TorchRL: (1) each episode has its own page and browser context
    (cookies and storage not shared), closed when the episode ends; TorchRL drives one page for
    the batch and closes the browser at every reset, partial ones too. (2) A failed action is a
    failure (TorchRL reports ``{'success': False, ...}`` as a success). (3) ``allowed_domains``
    matches the host exactly or as a parent domain (TorchRL's suffix test lets
    ``evilexample.com`` pass for ``example.com``), also filters every request the page makes,
    and only http(s) URLs open (TorchRL opens ``file://``). (4) ``scroll`` passes a checked
    integer amount as a script argument (TorchRL formats it into the script: a string runs as
    JavaScript). (5) No ``screenshot``: a text model cannot read an image (TorchRL lists it,
    then rejects it). (6) The browser runs on its own event loop thread (TorchRL's use of the
    caller's loop fails inside a running loop). (7) Chromium failing to launch raises
    :class:`BrowserUnavailable` instead of being shown to the model.
    """

    state_keys = ("browser_episode",)

    def __init__(
        self,
        allowed_domains: list[str] | None = None,
        headless: bool = True,
        timeout: float = 30.0,
        tokenizer: Any = None,
        tool_name: str = "tool",
        *,
        max_result_chars: int = 16384,
        max_workers: int = 1,
    ) -> None:
        try:
            from playwright.async_api import async_playwright  # noqa: F401
        except ImportError as exc:
            raise ImportError(f"BrowserTransform needs playwright and a browser: {INSTALL_HINT}") from exc
        super().__init__(tools={"browser": self.run_action}, tool_schemas={"browser": BROWSER_SCHEMA},
                         tool_name=tool_name, timeout=timeout, max_workers=max_workers)  # fmt: skip
        if max_result_chars < 1:
            raise ValueError(f"BrowserTransform max_result_chars must be >= 1, got {max_result_chars}")
        self.allowed_domains = [d.lower().strip(".") for d in allowed_domains] if allowed_domains else None
        self.headless, self.tokenizer, self.max_result_chars = headless, tokenizer, max_result_chars
        self._loop: EventLoopThread | None = None
        self._playwright = self.browser = None
        self.pages: dict[int, Any] = {}
        self._episode_ids = itertools.count()

    # ------------------------------------------------------------------ episodes

    def on_reset(self, td: TensorDictBase, reset_td: TensorDictBase) -> TensorDictBase:
        num = reset_td.batch_size[0]
        if self.pages and num == self._env().batch_size[0]:  # every episode starts over
            self._close_pages(list(self.pages))
        reset_td.set("browser_episode", torch.tensor([next(self._episode_ids) for _ in range(num)]))
        return reset_td

    def after_turn(self, td: TensorDictBase, done: list[bool]) -> None:
        if "browser_episode" in td.keys():
            episodes = td.get("browser_episode").view(-1).tolist()
            self._close_pages([e for row, e in enumerate(episodes) if done[row] and e in self.pages])

    # ------------------------------------------------------------------ calls

    def run_call(self, call: ToolCall, row: int, td: TensorDictBase) -> tuple[str, bool]:
        if call.error is None and call.tool != "browser":
            return f"Tool {call.tool} failed:\nTool {call.tool} not found (known: ['browser'])", False
        problem = call.error or action_problem(call.args, self.allowed_domains)
        if problem is None:
            episode = int(td.get("browser_episode")[row]) if "browser_episode" in td.keys() else -1 - row
            try:
                result = self.run_action(episode, call.args)
            except TimeoutError:
                problem = f"browser action timed out after {self.timeout}s"
            except BrowserUnavailable:
                raise
            except Exception as exc:  # the page's failure is the call's result, shown to the model
                problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            return f"Tool {call.tool} failed:\n{problem}", False
        text = json.dumps(result, ensure_ascii=False, default=str)
        if len(text) > self.max_result_chars:
            text = text[: self.max_result_chars] + f"\n[result truncated: more than {self.max_result_chars} characters]"
        return f"Tool browser executed successfully:\n{text}", True

    def run_action(self, episode: int, args: dict[str, Any]) -> dict[str, Any]:
        """Run one checked action on episode ``episode``'s page and return its result dict."""
        if self._loop is None:
            self._loop = EventLoopThread(name="BrowserTransform")
        return self._loop.run(self._act(episode, args), self.timeout)

    async def _act(self, episode: int, args: dict[str, Any]) -> dict[str, Any]:
        page = await self._page(episode)
        action = args["action"]
        if action == "navigate":
            response = await page.goto(args["url"], wait_until="networkidle")
            return {"url": page.url, "status": response.status if response is not None else None}
        if action == "click":
            await page.click(args["selector"])
            return {"clicked": args["selector"]}
        if action == "type":
            await page.fill(args["selector"], args["text"])
            return {"typed": args["text"], "into": args["selector"]}
        if action == "scroll":
            await page.evaluate("(dy) => window.scrollBy(0, dy)", args["scroll_amount"])
            return {"scrolled": args["scroll_amount"]}
        element = await page.wait_for_selector(args["selector"])
        if element is None:
            raise LookupError(f"Element not found: {args['selector']}")
        kind = args["extract_type"]
        if kind == "text":
            content = await element.text_content()
        elif kind == "html":
            content = await element.inner_html()
        else:
            content = await element.get_attribute(args["attribute"])
        return {"content": content, "type": kind}

    async def _page(self, episode: int) -> Any:
        if episode not in self.pages:
            browser = await self._started_browser()
            context = await browser.new_context()
            if self.allowed_domains:
                await context.route("**/*", self._filter_request)
            self.pages[episode] = await context.new_page()
        return self.pages[episode]

    async def _started_browser(self) -> Any:
        if self.browser is None:
            from playwright.async_api import async_playwright

            try:
                self._playwright = await async_playwright().start()
                self.browser = await self._playwright.chromium.launch(headless=self.headless)
            except Exception as exc:
                raise BrowserUnavailable(f"BrowserTransform could not launch Chromium ({exc}); {INSTALL_HINT}") from exc
        return self.browser

    async def _filter_request(self, route: Any) -> None:
        if url_problem(route.request.url, self.allowed_domains) is None:
            await route.continue_()
        else:
            await route.abort()

    # ------------------------------------------------------------------ teardown

    def _close_pages(self, episodes: list[int]) -> None:
        pages = [self.pages.pop(episode) for episode in episodes]
        if pages and self._loop is not None:
            self._loop.run(_close_all([page.context for page in pages]), self.timeout)

    def close(self) -> None:
        """Close every page, the browser and its loop (the transform starts them again if used)."""
        if self._loop is not None:
            self._close_pages(list(self.pages))
            if self.browser is not None:
                self._loop.run(_close_all([self.browser, _Stopper(self._playwright)]), self.timeout)
            self._loop.close()
        self._loop, self.browser, self._playwright = None, None, None
        super().close()

    def clone(self) -> BrowserTransform:
        """A new transform with the same options and no browser (TorchRL's ``clone``)."""
        return type(self)(self.allowed_domains, self.headless, self.timeout, self.tokenizer, self.tool_role,
                          max_result_chars=self.max_result_chars, max_workers=self.max_workers)  # fmt: skip

    def __repr__(self) -> str:
        return f"BrowserTransform(allowed_domains={self.allowed_domains}, headless={self.headless}, timeout={self.timeout})"


class _Stopper:
    """playwright's driver, closed like the other objects (its method is ``stop``)."""

    def __init__(self, playwright: Any) -> None:
        self.playwright = playwright

    async def close(self) -> None:
        if self.playwright is not None:
            await self.playwright.stop()


async def _close_all(closables: list[Any]) -> None:
    for closable in closables:
        await closable.close()
