"""Open every page of the built book in headless Chromium, as a reader with no network would.

    python tests/check_html.py [_build/html] [--screenshot PAGE=PNG]

Each page loads from file://, its scripts run, and the check waits for MathJax to typeset.
A page fails on a formula left as raw TeX or not rendered (every `.math` element Sphinx writes
must hold MathJax's output, and no `\\(`, `\\[` or `$$` may be left in the text), a MathJax
error, an image that did not load, a request for anything not on this machine (each one is
refused, so the check reads the book as an offline reader does even where a network is up),
a JavaScript error, or a Markdown table left as raw pipes (a paragraph whose text holds `|---|`
or starts with `| `: a table that reached the page as text). It prints one line a page and exits non-zero if any page failed; with
no browser, or no Playwright to drive it, it says how to install them and exits 2.
`make check-html` runs it on _build/html; tests/test_book_html.py on an unexecuted build.
"""
import argparse
import html.parser
import os
import pathlib
import re
import shutil
import sys

BROWSERS = ('chromium', 'chromium-browser', 'google-chrome', 'google-chrome-stable')
INSTALL = ('the HTML check needs Chromium and Playwright: install Chromium from your '
           'system\'s packages (Debian/Ubuntu: sudo apt-get install chromium; macOS: brew '
           'install --cask chromium) or point D2LPERF_BROWSER at a Chromium or Chrome '
           'binary, and pip install -e ".[test]" for Playwright')
MATHJAX_SECONDS = 30

PAGE_REPORT = """() => {
    const skip = 'mjx-container, script, style, pre, code, textarea, .highlight';
    const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
    const raw = [];
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        const text = node.textContent;
        if (/\\\\\\(|\\\\\\[|\\$\\$/.test(text) && !node.parentElement.closest(skip)) {
            raw.push(text.trim().slice(0, 60));
        }
    }
    const math = [...document.querySelectorAll('.math')];
    return {
        formulas: math.length,
        unrendered: math.filter(m => !m.querySelector('mjx-container')).length,
        tex_errors: document.querySelectorAll('mjx-merror').length,
        raw_tex: raw,
        images: document.images.length,
        broken_images: [...document.images]
            .filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src),
    };
}"""


class Paragraphs(html.parser.HTMLParser):
    """The text of every <p> of a page, each paragraph's whole text (its inline tags' too)."""

    def __init__(self):
        super().__init__()
        self.texts, self.depth = [], 0

    def handle_starttag(self, tag, attrs):
        if tag == 'p':
            if self.depth == 0:
                self.texts.append('')
            self.depth += 1

    def handle_endtag(self, tag):
        if tag == 'p' and self.depth:
            self.depth -= 1

    def handle_data(self, data):
        if self.depth:
            self.texts[-1] += data


# A table's rule row, `|---|`, as Sphinx's smart quotes leave it: `---` becomes an em dash.
RULE_ROW = re.compile(r'\|\s*:?[-\u2013\u2014]+:?\s*\|')


def raw_tables(page_html):
    """The paragraphs of a page that are a Markdown table nobody rendered (their first 60
    characters): a rule row `|---|`, or text that starts like a table row."""
    parser = Paragraphs()
    parser.feed(page_html)
    return [text.strip()[:60] for text in parser.texts
            if RULE_ROW.search(text) or text.lstrip().startswith('| ')]


def find_browser():
    """The browser to drive: $D2LPERF_BROWSER, else the first Chromium or Chrome on PATH."""
    named = os.environ.get('D2LPERF_BROWSER')
    if named:
        return named if shutil.which(named) else None
    return next(filter(None, map(shutil.which, BROWSERS)), None)


def missing_tools():
    """Why the check cannot run here (with what to install), or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return 'Playwright is not installed; ' + INSTALL
    if find_browser() is None:
        return 'no Chromium or Chrome found; ' + INSTALL
    return None


def pages(root):
    """Every page a reader can open, but the ones that only redirect (the book's index)."""
    return sorted(p for p in root.rglob('*.html')
                  if not {'_static', '_sources', '_images'} & set(p.relative_to(root).parts)
                  and 'http-equiv="Refresh"' not in p.read_text(errors='replace'))


def check_page(context, path, screenshot=None):
    """The failures of one page: a list of lines, empty when the page is whole."""
    page = context.new_page()
    remote, errors = [], []
    page.on('pageerror', lambda error: errors.append(f'JavaScript error: {error}'))
    page.on('console', lambda message: message.type == 'error'
            and errors.append(f'console error: {message.text}'))
    page.goto(path.as_uri(), wait_until='load')
    if page.evaluate('() => Boolean(window.MathJax && MathJax.startup)'):
        page.wait_for_function('() => MathJax.startup.promise', timeout=MATHJAX_SECONDS * 1e3)
        page.evaluate('() => MathJax.startup.promise')
    report = page.evaluate(PAGE_REPORT)
    remote = [r for r in context.remote_requests if r[0] == page]
    if screenshot:
        first = page.query_selector('mjx-container[display="true"]') or page.query_selector(
            'mjx-container')
        if first:
            first.scroll_into_view_if_needed()
        page.screenshot(path=str(screenshot))
    page.close()
    failures = [f'{report["unrendered"]} of {report["formulas"]} formulas not rendered'] \
        if report['unrendered'] else []
    failures += [f'{report["tex_errors"]} TeX errors'] if report['tex_errors'] else []
    failures += [f'raw TeX in the text: {text!r}' for text in report['raw_tex']]
    failures += [f'image did not load: {src}' for src in report['broken_images']]
    failures += [f'request off this machine: {url}' for _, url in remote]
    failures += [f'a Markdown table left as raw pipes: {text!r}'
                 for text in raw_tables(path.read_text(errors='replace'))]
    return failures + errors, report


def refuse_remote(context):
    """Answer every request that is not for a file with a refusal, and remember it."""
    context.remote_requests = []

    def route(route_):
        request = route_.request
        if request.url.startswith(('file:', 'data:', 'blob:')):
            route_.continue_()
        else:
            context.remote_requests.append((request.frame.page, request.url))
            route_.abort()
    context.route('**/*', route)


def check(root, screenshots=()):
    """Check every page under `root`; returns how many failed."""
    root = pathlib.Path(root).resolve()       # a page's file URI needs an absolute path
    from playwright.sync_api import sync_playwright
    shots = dict(screenshots)
    failed = 0
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=find_browser(),
            args=['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
                  '--disable-background-networking', '--disable-component-update',
                  '--disable-sync'])
        context = browser.new_context(viewport={'width': 1280, 'height': 800})
        refuse_remote(context)
        for path in pages(root):
            name = path.relative_to(root).as_posix()
            failures, report = check_page(context, path, shots.get(name))
            status = 'FAIL' if failures else 'ok'
            print(f'{status:4s} {name}: {report["formulas"]} formulas, '
                  f'{report["images"]} images')
            for line in failures:
                print(f'       {line}')
            failed += bool(failures)
        browser.close()
    return failed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('root', nargs='?', default='_build/html', type=pathlib.Path)
    parser.add_argument('--screenshot', action='append', default=[], metavar='PAGE=PNG',
                        help='also save a screenshot of PAGE (relative to root), scrolled '
                             'to its first displayed formula')
    args = parser.parse_args(argv)
    if not (args.root / 'index.html').exists():
        print(f'{args.root}/index.html is missing: build the book first (make book)')
        return 2
    why = missing_tools()
    if why:
        print(why)
        return 2
    screenshots = [tuple(s.split('=', 1)) for s in args.screenshot]
    failed = check(args.root, screenshots)
    total = len(pages(args.root))
    print(f'{total - failed} of {total} pages render whole offline')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
