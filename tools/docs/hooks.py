"""MkDocs hook: the site's pages include the repository's READMEs, so each text has one source.

A page under ``docs/`` holding a line ``<!-- include PATH -->`` (``PATH`` from the repository's
root; the line is invisible where the page is read on GitHub) gets that file's text in its
place. Links are rewritten on every page, included text and the page's own alike: a link to a
file or folder of the repository that the site also shows (a package's folder or README, a
guide under ``docs/``, RELEASING.md) becomes a link to that page, anchor kept; one the site
does not show is reported, so ``mkdocs build --strict`` fails on it.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: Files of the repository the site shows, and the page each is shown on.
PAGES = {
    "README.md": "index.md",
    "RELEASING.md": "releasing.md",
    "packages/gen-interface/README.md": "concepts/contract.md",
    "packages/gen-backend-kit/README.md": "writing-a-backend.md",
    "packages/gen-vllm/README.md": "backends/vllm.md",
    "packages/gen-hf/README.md": "backends/hf.md",
    "packages/gen-sglang/README.md": "backends/sglang.md",
    "packages/gen-remote/README.md": "backends/remote.md",
    "packages/gen-serve/README.md": "serving.md",
    "packages/gen-testkit/README.md": "testing.md",
}

_INCLUDE = re.compile(r"^<!-- include (?P<path>\S+) -->$", re.MULTILINE)
#: ``[text](target)`` and ``[text](target "title")``, not images' ``![...]``; no nested ``]``.
_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)

log = logging.getLogger("mkdocs.plugins.readmes")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Include the files a page names and rewrite its links for the site."""
    source = f"docs/{page.file.src_uri}"

    def include(match: re.Match[str]) -> str:
        path = match.group("path")
        try:
            text = (ROOT / path).read_text()
        except OSError as exc:
            log.warning("%s: cannot include %s: %s", source, path, exc)
            return match.group(0)
        return _rewrite(text, path, page.file.src_uri, source)

    markdown = _rewrite(markdown, source, page.file.src_uri, source)
    return _INCLUDE.sub(include, markdown)


def _rewrite(text: str, origin: str, page_uri: str, source: str) -> str:
    """``text`` (from the repository file ``origin``) with its relative links pointing where the
    page ``page_uri`` reaches them on the site; code blocks untouched."""
    pieces, last = [], 0
    for fence in _FENCE.finditer(text):
        pieces.append(_rewrite_links(text[last : fence.start()], origin, page_uri, source))
        pieces.append(fence.group(0))
        last = fence.end()
    pieces.append(_rewrite_links(text[last:], origin, page_uri, source))
    return "".join(pieces)


def _rewrite_links(text: str, origin: str, page_uri: str, source: str) -> str:
    def link(match: re.Match[str]) -> str:
        target = match.group("target")
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):  # a URL, an anchor, site-absolute
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(origin), path))
        if resolved.startswith("docs/") and resolved.endswith(".md"):
            page = resolved.removeprefix("docs/")
        else:
            page = PAGES.get(resolved) or PAGES.get(f"{resolved}/README.md", "")
        if not page:
            log.warning(
                "%s: a link to %s (from %s), which the site does not show: add it to "
                "PAGES in tools/docs/hooks.py, or link elsewhere",
                source,
                resolved,
                origin,
            )
            return match.group(0)
        relative = posixpath.relpath(page, posixpath.dirname(page_uri) or ".")
        new_target = relative + (f"#{anchor}" if anchor else "")
        return f"[{match.group('text')}]({new_target}{match.group('title') or ''})"

    return _LINK.sub(link, text)
