"""Every chapter's Markdown and notebook agree, and every chapter is in the book."""
import pathlib

import jupytext
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / 'chapters').glob('*.md'))


def cells(path):
    notebook = jupytext.read(path)
    return [(c.cell_type, c.source.strip(), c.metadata.get('tags', [])) for c in notebook.cells]


@pytest.mark.parametrize('markdown', CHAPTERS, ids=lambda p: p.stem)
def test_notebook_pair_agrees(markdown):
    notebook = markdown.with_suffix('.ipynb')
    assert notebook.exists(), f'{notebook.name} is missing: run make sync'
    assert cells(markdown) == cells(notebook), f'{markdown.name} and {notebook.name} differ: run make sync'


def test_every_chapter_is_in_the_table_of_contents():
    toc = yaml.safe_load((ROOT / '_toc.yml').read_text())
    listed = {entry['file'] for entry in toc['chapters']}
    assert listed == {f'chapters/{p.stem}' for p in CHAPTERS}


def test_chapter_notebooks_carry_no_outputs():
    for markdown in CHAPTERS:
        notebook = jupytext.read(markdown.with_suffix('.ipynb'))
        assert all(not c.get('outputs') for c in notebook.cells if c.cell_type == 'code')
