"""``/render``'s markdown: model text can never become markup of its own, code is highlighted by Pygments, and
the UI's address and CORS rules are the documented ones."""

from __future__ import annotations

import html
import random
from html.parser import HTMLParser

import pytest
from pygments import lex
from pygments.lexers import PythonLexer
from pygments.token import Keyword

from candle_vllm.api.binds import Bind
from candle_vllm.ui.cors import is_ui_origin
from candle_vllm.ui.render import render_markdown
from candle_vllm.ui.server import ui_bind_for

# Every tag markdown-it (CommonMark + tables + strikethrough) and our code blocks can emit.
ALLOWED_TAGS = {"p", "h1", "h2", "h3", "h4", "h5", "h6", "em", "strong", "s", "a", "img", "code", "pre", "ul", "ol",
                "li", "blockquote", "hr", "br", "table", "thead", "tbody", "tr", "th", "td", "div", "span", "button"}
ALLOWED_ATTRS = {"href", "src", "alt", "title", "class", "type", "aria-label", "target", "rel", "start"}
HOSTILE = [
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    '<a href="javascript:alert(1)">x</a>',
    "[click](javascript:alert(1))",
    "[click](JaVaScRiPt:alert(1))",
    "[click](vbscript:msgbox(1))",
    "![i](javascript:alert(1))",
    "[x](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)",
    "<iframe src=//evil></iframe>",
    "```<img src=x onerror=alert(1)>\ncode\n```",
    '<svg/onload=alert(1)>',
    "<style>body{display:none}</style>",
    "[a](<javascript:alert(1)>)",
    '<div style="position:fixed">x</div>',
]


class Elements(HTMLParser):
    """Collects (tag, attrs) of every start tag and the text, as a browser's tokenizer would see them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parse(markup: str) -> Elements:
    parser = Elements()
    parser.feed(markup)
    parser.close()
    return parser


def assert_safe(markup: str) -> None:
    for tag, attrs in parse(markup).tags:
        assert tag in ALLOWED_TAGS, (tag, markup)
        assert set(attrs) <= ALLOWED_ATTRS, (attrs, markup)
        for name in ("href", "src"):
            url = (attrs.get(name) or "").strip().lower()
            assert not url.startswith(("javascript:", "vbscript:", "data:text")), markup


@pytest.mark.parametrize("text", HOSTILE)
def test_raw_html_and_dangerous_links_never_become_markup(text: str) -> None:
    assert_safe(render_markdown(text))


def test_random_mixtures_of_markdown_and_html_stay_safe() -> None:
    rng = random.Random(1234)
    pieces = [*HOSTILE, "# head", "- item", "| a | b |\n|---|---|\n| 1 | 2 |", "```py\nx = 1\n", "`code`", "**b**",
              "> quote", "~~s~~", "[ok](https://example.org)", "\n\n", "<", ">", "&", '"', "'", "](", "<!--"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(1, 8)))
        assert_safe(render_markdown(text))


def test_fenced_code_keeps_its_text_and_gets_pygments_classes() -> None:
    code = 'def greet(name: str) -> str:\n    return f"<b>{name}</b> & co"\n'
    markup = render_markdown(f"Intro\n\n```python\n{code}```\n")
    tree = parse(markup)
    block = markup[markup.index("<code>") + len("<code>"):markup.index("</code>")]
    assert "".join(parse(block).text) == code  # what the copy button copies: the exact code
    keywords = {v for t, v in lex(code, PythonLexer()) if t in Keyword}  # Pygments' own token stream
    assert keywords == {"def", "return"}
    for word in keywords:
        assert f'<span class="k">{word}</span>' in block
    assert ("button", {"type": "button", "class": "copy", "aria-label": "Copy code"}) in tree.tags
    assert '<span class="lang">python</span>' in markup


def test_unknown_language_is_escaped_plain_text() -> None:
    markup = render_markdown('```no-such-lang"><img src=x>\n<tag> & x\n```')
    assert_safe(markup)
    block = markup[markup.index("<code>") + len("<code>"):markup.index("</code>")]
    assert "<span" not in block and html.unescape(block) == "<tag> & x\n"


def test_an_open_fence_mid_stream_renders_as_code() -> None:
    tags = [t for t, _ in parse(render_markdown("Here:\n\n```js\nconst a = 1;")).tags]
    assert "pre" in tags and "code" in tags


def test_tables_lists_headings_and_links() -> None:
    tree = parse(render_markdown("## Title\n\n- one\n- two\n\n| a | b |\n|---|---|\n| 1 | ~~2~~ |\n\n"
                                 "[site](https://example.org)"))
    tags = [t for t, _ in tree.tags]
    for tag in ("h2", "ul", "li", "table", "th", "td", "s", "a"):
        assert tag in tags
    link = next(attrs for t, attrs in tree.tags if t == "a")
    assert link == {"href": "https://example.org", "target": "_blank", "rel": "noopener noreferrer"}


@pytest.mark.parametrize(
    ("api", "ui"),
    [
        (Bind("tcp", "0.0.0.0:2000"), Bind("tcp", "0.0.0.0:1999")),
        (Bind("tcp", "127.0.0.1:8000"), Bind("tcp", "127.0.0.1:7999")),
        (Bind("tcp", "[::1]:8000"), Bind("tcp", "[::1]:7999")),
        (Bind("tcp", "127.0.0.1:0"), Bind("tcp", "127.0.0.1:0")),
    ],
)
def test_ui_listens_on_the_api_port_minus_one(api: Bind, ui: Bind) -> None:
    assert ui_bind_for(api) == ui


@pytest.mark.parametrize(("api", "says"), [(Bind("unix", "/tmp/a.sock"), "TCP"),
                                           (Bind("tcp", "127.0.0.1:1"), "at least 2")])
def test_ui_refuses_addresses_without_a_port_below(api: Bind, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ui_bind_for(api)


@pytest.mark.parametrize(
    ("origin", "host", "allowed"),
    [
        ("http://127.0.0.1:1999", "127.0.0.1:2000", True),
        ("http://localhost:1999", "localhost:2000", True),
        ("http://[::1]:1999", "[::1]:2000", True),
        ("http://localhost:1999", "127.0.0.1:2000", False),  # another site name, even if it resolves here
        ("http://evil.example:1999", "127.0.0.1:2000", False),
        ("http://127.0.0.1:3000", "127.0.0.1:2000", False),
        ("http://127.0.0.1", "127.0.0.1:2000", False),
        ("null", "127.0.0.1:2000", False),
        ("http://[bad:1999", "127.0.0.1:2000", False),
        ("", "127.0.0.1:2000", False),
    ],
)
def test_only_the_ui_page_may_call_the_api_cross_origin(origin: str, host: str, allowed: bool) -> None:
    assert is_ui_origin(origin, host, 1999) is allowed
    assert is_ui_origin(origin, host, None) is False
