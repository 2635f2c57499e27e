"""The built book reads offline: no page asks the network for a script, a stylesheet, an image
or a font, and (where a browser is installed) every page renders whole in headless Chromium.

Both checks build the book without running its cells (six seconds, not ten minutes): what is
checked here is the HTML around the outputs. `make check-html` checks the real _build/html.
"""
import html.parser
import pathlib
import re
import subprocess
import sys

import pytest

from tests import check_html

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Tags whose src or href the browser loads by itself; an <a href> is only a link to follow.
LOADED = {'script': 'src', 'img': 'src', 'iframe': 'src', 'source': 'src', 'video': 'src',
          'audio': 'src', 'embed': 'src', 'link': 'href'}
REMOTE = re.compile(r'^(https?:)?//', re.IGNORECASE)
CSS_REMOTE = re.compile(r'''(url\(\s*['"]?|@import\s+['"])\s*(https?:)?//''', re.IGNORECASE)


@pytest.fixture(scope='module')
def book(tmp_path_factory):
    """The book built with execution off, into a temporary folder."""
    pytest.importorskip('jupyter_book', reason='the book extra is not installed')
    out = tmp_path_factory.mktemp('book')
    config = out / '_config.yml'
    text = (ROOT / '_config.yml').read_text().replace(': _ext/', f': {ROOT / "_ext"}/')
    text, executing = re.subn(r'execute_notebooks: \w+', 'execute_notebooks: "off"', text)
    assert executing == 1, 'the book config no longer says how it executes the chapters'
    config.write_text(text)
    result = subprocess.run(
        [pathlib.Path(sys.executable).with_name('jupyter-book'), 'build', str(ROOT), '--builder',
         'html', '--config', str(config), '--path-output', str(out)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    html = out / '_build' / 'html'
    assert (html / 'chapters' / 'parameter_servers.html').exists(), result.stdout[-3000:]
    return html


LOADED_LINKS = {'stylesheet', 'icon', 'preload', 'modulepreload', 'manifest'}


class LoadedURLs(html.parser.HTMLParser):
    """The URLs a page makes the browser fetch by itself, as `<tag attribute="url">`."""

    def __init__(self):
        super().__init__()
        self.urls = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        attribute = LOADED.get(tag)
        if tag == 'link' and not LOADED_LINKS & set((attrs.get('rel') or '').split()):
            return
        if attribute and attrs.get(attribute):
            self.urls.append(f'<{tag} {attribute}="{attrs[attribute]}">')


def test_no_page_loads_anything_from_the_network(book):
    remote = []
    for page in sorted(book.rglob('*.html')):
        parser = LoadedURLs()
        parser.feed(page.read_text(errors='replace'))
        remote += [f'{page.relative_to(book)}: {url}' for url in parser.urls
                   if REMOTE.match(url.split('="', 1)[1])]
    for sheet in sorted(book.rglob('*.css')):
        if CSS_REMOTE.search(sheet.read_text(errors='replace')):
            remote.append(f'{sheet.relative_to(book)}: a remote url() or @import')
    assert remote == []


def test_the_math_renderer_is_in_the_book(book):
    page = (book / 'chapters' / 'parameter_servers.html').read_text()
    assert 'src="../_static/mathjax/tex-chtml.js"' in page
    assert (book / '_static' / 'mathjax' / 'tex-chtml.js').exists()
    assert (book / '_static' / 'mathjax' / 'output' / 'chtml' / 'fonts' / 'woff-v2').is_dir()


def test_the_check_finds_what_it_looks_for(tmp_path, capsys, monkeypatch):
    """check_html's own report: a page with raw TeX, a table left as pipes, a missing image
    and a remote script, from a root given relative to the working directory, as `make
    check-html` gives it."""
    if check_html.missing_tools():
        pytest.skip(check_html.missing_tools())
    (tmp_path / 'index.html').write_text('<html><body>redirect</body></html>')
    (tmp_path / 'bad.html').write_text(
        '<html><body><p>raw \\(x^2\\) left</p><p>| a | b |</p><img src="missing.png">'
        '<script src="https://cdn.example.org/x.js"></script></body></html>')
    monkeypatch.chdir(tmp_path.parent)
    assert check_html.check(pathlib.Path(tmp_path.name)) == 1   # index.html whole, bad.html not
    report = capsys.readouterr().out
    assert 'raw TeX in the text' in report and 'missing.png' in report
    assert "a Markdown table left as raw pipes: '| a | b |'" in report
    assert 'request off this machine: https://cdn.example.org/x.js' in report


def test_a_table_left_as_raw_pipes_is_found():
    """A Markdown table that reached the page as one paragraph of pipes is a failure; a real
    table, a code block with pipes, and a paragraph that mentions a pipe are not."""
    page = ('<html><body><p>| step | ms |\n|---|---|\n| one | 1.0 |</p>'
            '<p>|<em>a</em> | b |<br>| --- | --- |</p>'
            '<table><tr><td>| one</td></tr></table><pre>| a |\n|---|</pre>'
            '<p>x | y is a bitwise or</p><p>| a |</p>'
            '<p>Sphinx made an em dash: a|\u2014|\u2014|</p></body></html>')
    assert check_html.raw_tables(page) == ['| step | ms |\n|---|---|\n| one | 1.0 |',
                                           '|a | b || --- | --- |', '| a |',
                                           'Sphinx made an em dash: a|\u2014|\u2014|']


def test_every_page_renders_whole_offline_in_a_browser(book, capsys):
    if check_html.missing_tools():
        pytest.skip(check_html.missing_tools())
    failed = check_html.check(book)
    assert failed == 0, capsys.readouterr().out
