"""Every image the book shows exists, and the scripts in images/ redraw theirs the same way
every time (`make figures`)."""
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / 'chapters').glob('*.md')) + [ROOT / 'intro.md']
SCRIPTS = sorted(path for path in (ROOT / 'images').glob('*.py')
                 if re.search(r'^def main\(', path.read_text(), re.M))
IMAGE_REFERENCES = re.compile(r'^`{3,}\{(?:figure|image)\}\s+(\S+)'       # MyST directives
                              r'|!\[[^\]]*\]\(([^)\s]+)'                    # Markdown images
                              r'|<img\s[^>]*src="([^"]+)"', re.M)          # HTML images
# Runs a drawing script with its output folder moved, as `make figures` would run it.
DRAW_INTO = """
import importlib.util, pathlib, sys
sys.path.insert(0, str(pathlib.Path(sys.argv[1]).parent))
spec = importlib.util.spec_from_file_location('figure_script', sys.argv[1])
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
script.HERE = pathlib.Path(sys.argv[2])
script.main()
"""


def referenced_images(page):
    return [next(group for group in found.groups() if group)
            for found in IMAGE_REFERENCES.finditer(page.read_text())]


def test_the_reader_of_references_finds_every_form(tmp_path):
    page = tmp_path / 'page.md'
    page.write_text('```{figure} ../images/a.svg\n:name: x\n```\n\n'
                    '````{image} b.png\n````\n![a chart](c/d.svg) <img alt="" src="e.png">\n')
    assert referenced_images(page) == ['../images/a.svg', 'b.png', 'c/d.svg', 'e.png']


@pytest.mark.parametrize('page', PAGES, ids=lambda p: p.name)
def test_every_image_a_page_shows_exists(page):
    missing = [image for image in referenced_images(page)
               if not re.match(r'https?://', image) and not (page.parent / image).is_file()]
    assert not missing, f'{page.name} shows images that do not exist: {missing}'


def test_the_chapters_show_the_schematics_of_images():
    shown = {(page.parent / image).resolve() for page in PAGES for image in
             referenced_images(page)}
    assert {path.resolve() for path in (ROOT / 'images').glob('*.svg')} <= shown


@pytest.mark.parametrize('script', SCRIPTS, ids=lambda p: p.name)
def test_a_drawing_script_redraws_its_figures_byte_for_byte(script, tmp_path):
    drawn = []
    for attempt in ('first', 'second'):
        folder = tmp_path / attempt
        folder.mkdir()
        subprocess.run([sys.executable, '-c', DRAW_INTO, str(script), str(folder)], check=True,
                       timeout=300)
        drawn.append({path.name: path.read_bytes() for path in folder.iterdir()})
    assert drawn[0] and drawn[0] == drawn[1]                 # no dates, no random ids
    assert all((ROOT / 'images' / name).is_file() for name in drawn[0]), sorted(drawn[0])


def test_every_other_module_in_images_is_used_by_a_drawing_script():
    helpers = {path.stem for path in (ROOT / 'images').glob('*.py')} - {p.stem for p in SCRIPTS}
    used = {name for script in SCRIPTS
            for name in re.findall(r'^from (\w+) import', script.read_text(), re.M)}
    assert helpers <= used, f'images/ holds modules no drawing script uses: {helpers - used}'
