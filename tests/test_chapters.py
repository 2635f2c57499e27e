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



def test_the_introduction_lists_the_chapters_in_the_books_order():
    """The introduction's table is the reader's map: the same chapters, in _toc.yml's order."""
    import re
    toc = yaml.safe_load((ROOT / '_toc.yml').read_text())
    labels = {}
    for entry in toc['chapters']:
        text = (ROOT / f"{entry['file']}.md").read_text()
        labels[re.search(r'^\((sec-[\w-]+)\)=$', text, re.M).group(1)] = entry['file']
    intro = (ROOT / 'intro.md').read_text()
    listed = re.findall(r'^\| \{ref\}`(sec-[\w-]+)`', intro, re.M)
    assert [labels.get(label) for label in listed] == [e['file'] for e in toc['chapters']]

def test_chapter_notebooks_carry_no_outputs():
    for markdown in CHAPTERS:
        notebook = jupytext.read(markdown.with_suffix('.ipynb'))
        assert all(not c.get('outputs') for c in notebook.cells if c.cell_type == 'code')


@pytest.mark.parametrize('markdown', CHAPTERS, ids=lambda p: p.stem)
def test_each_glue_name_is_glued_once(markdown):
    """myst-nb refuses a name glued twice in one page, and only the book build would say so."""
    import collections
    import re
    names = collections.Counter(re.findall(r"\bglue\(\s*'([^']+)'", markdown.read_text()))
    assert not [name for name, count in names.items() if count > 1], names.most_common(3)


@pytest.mark.parametrize('markdown', CHAPTERS, ids=lambda p: p.stem)
def test_markdown_glued_is_shown_as_markdown(markdown):
    """A value glued as Markdown(...) reads in the prose only through {glue:md}: {glue:text}
    prints its repr, '<IPython.core.display.Markdown object>', into the page."""
    import re
    text = markdown.read_text()
    as_markdown = set(re.findall(r"\bglue\(\s*f?'([^'{]+)'\s*,\s*Markdown\(", text))
    as_text = set(re.findall(r'\{glue:text\}`([^`:]+)', text))
    assert not as_markdown & as_text, (
        f'{markdown.name}: use {{glue:md}} for {sorted(as_markdown & as_text)}')


@pytest.mark.parametrize('markdown', CHAPTERS, ids=lambda p: p.stem)
def test_lines_fit_in_100_characters(markdown):
    long = [n for n, line in enumerate(markdown.read_text().splitlines(), 1) if len(line) > 100]
    assert not long, f'{markdown.name}: lines {long} are over 100 characters'


@pytest.mark.parametrize('markdown', CHAPTERS, ids=lambda p: p.stem)
def test_d2lperf_is_imported_before_numpy(markdown):
    """In a Jupyter kernel, whose own threads rule out restarting OpenBLAS's, d2lperf sets
    OpenBLAS's brief spin only if NumPy has not loaded it yet (engine/blas.py, spin_briefly):
    a chapter that imports NumPy or matplotlib first runs with OpenBLAS's idle threads
    spinning on the cores its devices share."""
    import re
    code = '\n'.join(source for kind, source, _ in cells(markdown) if kind == 'code')
    first = {name: match.start() for name, pattern in (
        ('d2lperf', r'^(import|from) d2lperf\b'), ('numpy', r'^(import|from) (numpy|matplotlib)\b'))
        for match in [re.search(pattern, code, re.MULTILINE)] if match}
    assert first.get('d2lperf', 0) <= first.get('numpy', len(code)), (
        f'{markdown.name} imports NumPy or matplotlib before d2lperf')
