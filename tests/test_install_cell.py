"""Each chapter opens with a cell that installs d2lperf where it is missing, as on Colab.

The book's Binder and Colab buttons open a chapter's notebook on a machine that has never seen
this repository. Binder builds from binder/requirements.txt; Colab has no such file, so the
first cell of every chapter (tagged `remove-cell`: the HTML leaves it out) installs d2lperf
from the repository `_config.yml` names, and myst-nb for `glue`. Where both are installed (a
clone after `make`, the book build, nbval) it must do nothing, since those may have no network.

The install path is checked for real: the cell's own code, in a fresh virtual environment,
with `D2LPERF_INSTALL_URL` pointing at a local clone instead of GitHub (about 30 seconds, most
of it pip installing NumPy, matplotlib and myst-nb from its cache or PyPI).
"""
import os
import pathlib
import shutil
import subprocess
import sys
import types

import pytest
import yaml

from tests import run_chapter

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / 'chapters').glob('*.md'))
# The chapters whose jobs run over MPI install d2lperf with MPICH and mpi4py.
MPI_CHAPTERS = {'data_parallel_at_scale', 'distributed_training'}


def install_cell(markdown):
    """(source, tags) of the chapter's first code cell, read as tests/run_chapter.py reads it."""
    _, source, tags = run_chapter.read_cells(markdown.read_text())[0]
    return source, tags


def repository():
    return yaml.safe_load((ROOT / '_config.yml').read_text())['repository']


@pytest.mark.parametrize('markdown', CHAPTERS, ids=lambda p: p.stem)
def test_each_chapter_opens_with_the_install_cell(markdown):
    source, tags = install_cell(markdown)
    extras = '[mpi]' if markdown.stem in MPI_CHAPTERS else ''
    home = repository()
    assert tags == ['remove-cell'], 'the install cell is for Colab, not for the HTML'
    assert "if missing('d2lperf'):" in source
    assert f"'D2LPERF_INSTALL_URL', 'git+{home['url']}@{home['branch']}'" in source
    assert f"'pip', 'install', f'd2lperf{extras} @ {{url}}'" in source
    assert 'numpy' not in source and 'matplotlib' not in source   # d2lperf loads NumPy first


def test_every_chapter_has_the_same_install_cell():
    sources = {install_cell(markdown)[0].replace('d2lperf[mpi] @', 'd2lperf @')
               for markdown in CHAPTERS}
    assert len(sources) == 1, 'edit every chapter\'s install cell alike'


def test_the_launch_buttons_point_at_the_repository_the_cells_install_from():
    config = yaml.safe_load((ROOT / '_config.yml').read_text())
    assert config['launch_buttons']['colab_url'] and config['launch_buttons']['binderhub_url']
    assert config['repository']['url'].startswith('https://github.com/')
    assert '.[mpi]' in (ROOT / 'binder' / 'requirements.txt').read_text().split()


@pytest.mark.parametrize('markdown', CHAPTERS, ids=lambda p: p.stem)
def test_the_cell_does_nothing_where_d2lperf_is_installed(markdown, monkeypatch):
    """No pip and no network where d2lperf and myst-nb are importable (nbval, the book, CI)."""
    import importlib.util
    if importlib.util.find_spec('myst_nb') is None:
        pytest.skip('myst-nb is not installed here (the book extra), so the cell would install it')

    def refuse(command, *args, **kwargs):
        raise AssertionError(f'the install cell ran {command}')
    monkeypatch.setattr(subprocess, 'check_call', refuse)
    monkeypatch.setenv('D2LPERF_INSTALL_URL', 'git+file://localhost/nowhere')
    exec(compile(install_cell(markdown)[0], markdown.name, 'exec'), {})


def test_the_cell_takes_a_stand_in_for_myst_nb_as_installed(monkeypatch):
    """tests/run_chapter.py (make gpu-check) puts a module of its own in myst_nb's place,
    which has no spec: find_spec raised ValueError on it."""
    def refuse(command, *args, **kwargs):
        raise AssertionError(f'the install cell ran {command}')
    monkeypatch.setattr(subprocess, 'check_call', refuse)
    monkeypatch.setitem(sys.modules, 'myst_nb', types.ModuleType('myst_nb'))
    exec(compile(install_cell(ROOT / 'chapters' / 'hybridize.md')[0], 'hybridize', 'exec'), {})


def test_the_cell_installs_d2lperf_from_a_clone_into_a_fresh_venv(tmp_path):
    if shutil.which('git') is None or not (ROOT / '.git').exists():
        pytest.skip('needs git and a git checkout to clone')
    clone, environment = tmp_path / 'clone', tmp_path / 'venv'
    # A clone holds what is committed, which is what pip would fetch from GitHub.
    subprocess.run(['git', 'clone', '--quiet', str(ROOT), str(clone)], check=True)
    subprocess.run([sys.executable, '-m', 'venv', str(environment)], check=True)
    python = environment / 'bin' / 'python'
    source = install_cell(ROOT / 'chapters' / 'hybridize.md')[0]
    env = {name: value for name, value in os.environ.items()
           if name not in ('PYTHONPATH', 'VIRTUAL_ENV')}
    # git+file://localhost/...: the pip that `venv` bundles refuses `name @ git+file:///path`
    # (a URL with an empty host); git reads both the same.
    env['D2LPERF_INSTALL_URL'] = f'git+file://localhost{clone}'
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    # The working directory is tmp_path, not the repository, whose d2lperf/ would be found.
    installed = subprocess.run([python, '-c', source], **run)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]

    check = ('import d2lperf, myst_nb, importlib.metadata as m\n'
             'print(d2lperf.__file__)\n'
             'print(m.distribution("d2lperf").read_text("direct_url.json"))\n')
    imported = subprocess.run([python, '-c', check], **run)
    assert imported.returncode == 0, imported.stderr[-3000:]
    where, origin = imported.stdout.split('\n', 1)
    assert pathlib.Path(where).is_relative_to(environment), where
    assert str(clone) in origin and '"vcs": "git"' in origin, origin

    env['D2LPERF_INSTALL_URL'] = 'git+file://localhost/nowhere'
    env['PIP_NO_INDEX'] = '1'
    again = subprocess.run([python, '-c', source], **run)
    assert again.returncode == 0 and again.stdout == '', again.stdout + again.stderr
