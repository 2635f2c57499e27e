"""Keep the built book readable with no network.

MathJax comes from `_static` (the sphinx-mathjax-offline extension, set up in _config.yml).
What is left to do here: jupyter-book always loads sphinx-thebe, whose scripts serve a "live
code" button this book does not show. They name a script on unpkg.com, and sphinx-thebe adds
its settings twice, which is a JavaScript error on every page. So every page drops them.
"""


def is_thebe(asset):
    """A script or stylesheet of sphinx-thebe's: its file, or the inline settings it adds."""
    name = getattr(asset, 'filename', None) or str(asset)
    body = getattr(asset, 'attributes', {}).get('body') or ''
    return 'thebe' in name or 'THEBE_JS_URL' in body


def drop_thebe(app, pagename, templatename, context, doctree):
    for key in ('script_files', 'css_files'):
        if key in context:
            context[key] = [asset for asset in context[key] if not is_thebe(asset)]


def setup(app):
    app.connect('html-page-context', drop_thebe, priority=900)
    return {'parallel_read_safe': True, 'parallel_write_safe': True}
