"""Markdown to safe HTML for the chat page: markdown-it-py (CommonMark + tables + strikethrough) with raw HTML
disabled, and Pygments for fenced code.

Rendering on the server keeps the page free of third-party JavaScript (nothing to bundle, nothing fetched
from a CDN), and the output is safe to assign to ``innerHTML``: every character of the model's text reaches
the page escaped, except the markup markdown-it and Pygments generate themselves; markdown-it drops
``javascript:``/``vbscript:``/``file:`` links and non-image ``data:`` URLs.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml
from markdown_it.token import Token
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexer import Lexer
from pygments.lexers import TextLexer, get_lexer_by_name
from pygments.util import ClassNotFound

CODE_STYLE = "github-dark"  # Pygments style of code blocks (the page draws them on a dark background)
CODE_CSS_SCOPE = ".hl"


@lru_cache(maxsize=128)
def _lexer(language: str) -> Lexer:
    """The Pygments lexer for a fence's language name; unknown or missing names give plain text."""
    try:
        return get_lexer_by_name(language, stripnl=False, ensurenl=False)
    except ClassNotFound:
        return TextLexer(stripnl=False, ensurenl=False)


def highlight_code(code: str, language: str) -> str:
    """One code block with its header (language, copy button); the page wires the button up."""
    spans = highlight(code, _lexer(language.lower()), HtmlFormatter(nowrap=True))
    label = escapeHtml(language) if language else "text"
    return (
        f'<div class="codeblock"><div class="codehead"><span class="lang">{label}</span>'
        f'<button type="button" class="copy" aria-label="Copy code">Copy</button></div>'
        f'<pre class="hl"><code>{spans}</code></pre></div>\n'
    )


def _fence(self: Any, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
    token = tokens[idx]
    language = token.info.strip().split(maxsplit=1)[0] if token.info.strip() else ""
    return highlight_code(token.content, language)


def _code_block(self: Any, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
    return highlight_code(tokens[idx].content, "")


def _link_open(self: Any, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
    # Links open outside the chat and give the target no handle on this page.
    tokens[idx].attrSet("target", "_blank")
    tokens[idx].attrSet("rel", "noopener noreferrer")
    return self.renderToken(tokens, idx, options, env)


def _build() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "typographer": False}).enable(["table", "strikethrough"])
    md.add_render_rule("fence", _fence)
    md.add_render_rule("code_block", _code_block)
    md.add_render_rule("link_open", _link_open)
    return md


_MD = _build()


def render_markdown(text: str) -> str:
    """HTML for ``text`` (the model's markdown, possibly cut mid-stream: an open fence renders as a code block)."""
    return _MD.render(text)


def code_css() -> str:
    """The stylesheet for highlighted code, scoped to ``.hl``."""
    return HtmlFormatter(style=CODE_STYLE).get_style_defs(CODE_CSS_SCOPE)
