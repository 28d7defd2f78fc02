"""Attacker text, made inert for each place it is shown.

Everything in an alert comes from an anomaly, and an anomaly from telemetry: label values
(a NIC's ``rate`` string, a GPU's name), event details, entity names. A collector chose
them, so none of it may format, link, mention or break lines where on-call reads it. Two
steps:

* `untrusted` (format-independent, applied to every field when an alert is built): control
  and format characters (newlines, ANSI escapes, bidi overrides, zero-width characters)
  become spaces, whitespace collapses to single spaces, and URLs are defanged
  (``http://x`` -> ``http[:]//x``, ``www.`` -> ``www[.]``) so no client turns them into
  links; the length is capped.
* the markup of each destination: `slack_escape` (``&``, ``<``, ``>`` as Slack requires;
  the sink also sends plain_text blocks, so ``*bold*`` and ``<!channel>`` stay text), and
  `markup_neutral` for WeCom markdown and Feishu (``<font>``, ``<@user>``, ``<at>``,
  ``[link](url)``, ``**``, ``#``, `` ` ``, ``>`` and ``@`` become their full-width
  look-alikes, which read the same and mean nothing).

>>> untrusted("400 Gb/sec\\n<!channel> http://evil.example/x \\x1b[31mURGENT\\u202e")
'400 Gb/sec <!channel> http[:]//evil.example/x [31mURGENT'
>>> slack_escape("<!channel> & <http://x|y>")
'&lt;!channel&gt; &amp; &lt;http://x|y&gt;'
>>> markup_neutral('<font color="warning">URGENT</font> [click](http[:]//x) @all **now** # h')
'＜font color="warning"＞URGENT＜/font＞ ［click］(http［:］//x) ＠all ＊＊now＊＊ ＃ h'
"""
from __future__ import annotations

import re
import unicodedata

MAX_FIELD_CHARS = 4000
_SCHEME = re.compile(r"(?i)\b([a-z][a-z0-9+.-]{0,30}):/+")
_WWW = re.compile(r"(?i)\bwww\.")
# Every character whose category is a control (Cc), format (Cf: bidi overrides, zero-width
# joiners), line or paragraph separator (Zl, Zp), surrogate or unassigned/private use.
_INVISIBLE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
_MARKUP = str.maketrans({"<": "＜", ">": "＞", "[": "［", "]": "］", "*": "＊", "`": "｀", "#": "＃", "@": "＠",
                         "~": "～", "|": "｜"})


def _visible(ch: str) -> str:
    return " " if unicodedata.category(ch) in _INVISIBLE else ch


def untrusted(text: str, max_chars: int = MAX_FIELD_CHARS) -> str:
    """One line of inert text: no control characters, no line breaks, no live URLs."""
    text = "".join(map(_visible, str(text)[: max_chars * 2]))
    text = " ".join(text.split())
    text = _WWW.sub("www[.]", _SCHEME.sub(lambda m: f"{m.group(1)}[:]//", text))
    return text[:max_chars]


def slack_escape(text: str) -> str:
    """The three characters Slack's text fields must escape."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# What can start a link, an image, emphasis, code, raw HTML or a new cell inside a line
# (`_` is left: names are full of it, and intraword emphasis does not exist in GFM).
_MARKDOWN_SPECIAL = re.compile(r"([\\`*\[\]|<>])")


def markdown_text(text: str) -> str:
    r"""Inert text inside CommonMark/GFM (a report's table cell): one line, every markup character
    backslash-escaped, so a name cannot become a link, an image, emphasis or a new cell.

    >>> print(markdown_text("leaf-1 [click](http://x.example) | **URGENT**"))
    leaf-1 \[click\](http\[:\]//x.example) \| \*\*URGENT\*\*
    """
    return _MARKDOWN_SPECIAL.sub(r"\\\1", untrusted(text))


def markup_neutral(text: str) -> str:
    """WeCom markdown / Feishu markup characters as full-width look-alikes (no escape syntax exists)."""
    return text.translate(_MARKUP)
