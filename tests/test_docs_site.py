"""The documentation site: `mkdocs build --strict` passes (a broken link or a page missing from the nav fails it),
every link inside the built site lands on a page and an anchor that exist, and the README stays short and its
links resolve."""

import html.parser
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_BYTES = 12 * 1024

pytestmark = pytest.mark.docs


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value is None:
                continue
            if name == "id":
                self.ids.add(value)
            elif (tag, name) in (("a", "href"), ("link", "href"), ("img", "src"), ("script", "src")):
                self.links.append(value)


def _parse(page: Path) -> _Links:
    parser = _Links()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


def _target(page: Path, link: str, site: Path) -> tuple[Path, str] | None:
    """The file and anchor a relative link of page points at; None for one that leaves the site."""
    parts = urlsplit(link)
    if parts.scheme or parts.netloc or link.startswith(("mailto:", "data:")):
        return None
    path = unquote(parts.path)
    if not path:
        return page, parts.fragment
    target = (site / path.lstrip("/")) if path.startswith("/") else (page.parent / path)
    if target.is_dir() or path.endswith("/"):
        target = target / "index.html"
    return target.resolve(), parts.fragment


def broken_links(site: Path) -> list[str]:
    pages = {p.resolve(): _parse(p) for p in site.rglob("*.html")}
    broken = []
    for page, parsed in pages.items():
        for link in parsed.links:
            found = _target(page, link, site)
            if found is None:
                continue
            target, anchor = found
            where = page.relative_to(site.resolve())
            if not target.exists():
                broken.append(f"{where}: {link} (no {target.name})")
            elif anchor and target.suffix == ".html" and anchor not in pages[target].ids:
                broken.append(f"{where}: {link} (no anchor #{anchor})")
    return sorted(set(broken))


@pytest.mark.process
def test_every_link_inside_the_built_site_lands_on_a_page_and_an_anchor(site):
    assert len(list(site.rglob("*.html"))) > 15
    broken = broken_links(site)
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)


def test_the_check_sees_a_missing_page_and_a_missing_anchor(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "index.html").write_text('<h1 id="top">x</h1><a href="a/">ok</a><a href="#top">ok</a>'
                                         '<a href="b/">gone</a><a href="a/#nope">gone</a><a href="https://x.org/">out</a>')
    (tmp_path / "a" / "index.html").write_text('<a href="../#top">ok</a>')
    assert broken_links(tmp_path) == ["index.html: a/#nope (no anchor #nope)", "index.html: b/ (no index.html)"]


def test_the_docs_home_is_the_readme():
    """docs/index.md is README.md with its links seen from docs/: one text, two places it is read."""
    readme = (ROOT / "README.md").read_text()
    assert (ROOT / "docs" / "index.md").read_text() == readme.replace("](docs/", "]("), \
        "docs/index.md differs from README.md: copy it (links to docs/X become X)"


def test_the_readme_is_short_and_its_links_resolve():
    readme = ROOT / "README.md"
    size = len(readme.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; the docs site is the home of the rest"
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme.read_text()):
        if not urlsplit(link).scheme:
            assert (ROOT / link).exists(), f"README.md links to {link}, which is not in the repository"
