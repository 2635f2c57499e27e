"""Build the book from the outputs that `make test` computed, where they are still current.

`make test` runs every chapter under nbval; `chapters/conftest.py` keeps a chapter's outputs in
`_build/executed/NAME.ipynb` when all its cells pass, stamped by `stamp`. The book executes its
chapters through myst-nb's cache (`execute_notebooks: cache` in _config.yml). Before the
chapters are read, this extension empties that cache, so that nothing computed by an earlier
package is shown (the cache's own key sees only the code cells), and fills it with each kept
chapter whose stamp matches the sources now. myst-nb then takes those outputs and executes
every other chapter as before. In CI, `make test` then `make book` runs each chapter once.
"""
import hashlib
import os
import pathlib

from sphinx.util import logging

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXECUTED = ROOT / '_build' / 'executed'


def stamp(chapter):
    """What a chapter's outputs depend on, hashed: its source, the package and quick mode."""
    digest = hashlib.sha256(os.environ.get('D2LPERF_QUICK', '').encode())
    sources = [ROOT / 'chapters' / f'{chapter}.md', ROOT / 'chapters' / f'{chapter}.ipynb']
    sources += sorted(path for path in (ROOT / 'd2lperf').rglob('*')
                      if path.is_file() and '__pycache__' not in path.parts)
    for path in sources:
        digest.update(str(path.relative_to(ROOT)).encode() + b'\0' + path.read_bytes())
    return digest.hexdigest()


def current_outputs(chapter):
    """The kept notebook of a chapter, or None where there is none or its stamp is stale."""
    import nbformat
    path = EXECUTED / f'{chapter}.ipynb'
    if not path.exists():
        return None
    kept = nbformat.read(str(path), as_version=4)
    return kept if kept.metadata.get('d2lperf_executed', {}).get('stamp') == stamp(chapter) else None


def with_outputs(notebook, kept):
    """The notebook as myst-nb read it, with the kept outputs, or None where their code
    cells differ (then the chapter is executed)."""
    cells = [cell for cell in notebook.cells if cell.cell_type == 'code']
    kept_cells = [cell for cell in kept.cells if cell.cell_type == 'code']
    if [c.source.strip() for c in cells] != [c.source.strip() for c in kept_cells]:
        return None
    for cell, kept_cell in zip(cells, kept_cells):
        cell.outputs, cell.execution_count = kept_cell.outputs, kept_cell.execution_count
    return notebook


def fill_cache(app, env, docnames):
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn
    from myst_nb.core.read import create_nb_reader
    if env.mystnb_config.execution_mode != 'cache':      # "off" or "force": no cache to fill
        return
    cache = get_cache(env.mystnb_config.execution_cache_path or '.jupyter_cache')
    cache.clear_cache()
    taken = []
    for docname in docnames:
        path = pathlib.Path(env.doc2path(docname))
        kept = current_outputs(path.stem) if path.parent == ROOT / 'chapters' else None
        if kept is None:
            continue
        text = path.read_text()
        reader = create_nb_reader(str(path), env.myst_config, env.mystnb_config, text)
        notebook = with_outputs(reader.read(text), kept) if reader else None
        if notebook is not None:
            cache.cache_notebook_bundle(CacheBundleIn(notebook, str(path)),
                                        check_validity=False, overwrite=True)
            taken.append(path.stem)
    logging.getLogger(__name__).info(
        f'outputs of {len(taken)} chapters taken from the test run ({", ".join(taken) or "none"});'
        ' the others are executed now')


def setup(app):
    app.connect('env-before-read-docs', fill_cache)
    return {'parallel_read_safe': True, 'parallel_write_safe': True}
