"""Every command the README shows exists once the README's own set-up steps have run.

The commands are read from the README's ```bash blocks: `make TARGET` needs the target in
the Makefile, `.venv/bin/X` needs X in the virtual environment these tests run in (the
`.venv` of the README), `pip install -e '.[EXTRA]'` needs the extra in pyproject.toml, and
`python3 SCRIPT` needs the script. A program that only an extra brings (JupyterLab, from
`[notebook]`) is checked where the extras the README installs before it are installed, and
skipped, with the reason, where they are not (`make test` installs no JupyterLab).
"""
import importlib.metadata
import json
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip('tomllib')

ROOT = pathlib.Path(__file__).resolve().parents[1]
VENV_BIN = pathlib.Path(sys.executable).parent
EXTRAS = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project'][
    'optional-dependencies']
INSTALL = re.compile(r"pip install[^'\"]*-e ['\"]?\.\[([\w,-]+)\]")


def readme_commands():
    """(words, extras installed by the README's set-up before it) of each README command."""
    text = (ROOT / 'README.md').read_text()
    installed = set(INSTALL.search((ROOT / 'Makefile').read_text())[1].split(','))
    commands = []
    for block in re.findall(r'^```bash\n(.*?)^```', text, re.M | re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r'[A-Z_][A-Z0-9_]*=\S*', words[0]):
                words = words[1:]                        # VAR=value before the command
            if words and words[0] != '...':
                commands.append((words, frozenset(installed)))
            if found := INSTALL.search(line):
                installed |= set(found[1].split(','))
    return commands


COMMANDS = readme_commands()


def extra_is_installed(extra):
    """Whether every requirement of the extra is installed here, in a version it accepts."""
    for text in EXTRAS[extra]:
        requirement = Requirement(text)
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            return False
        if not requirement.specifier.contains(version, prereleases=True):
            return False
    return True


def test_the_readme_shows_the_commands_this_test_knows():
    programs = {words[0] for words, _ in COMMANDS}
    assert {'make', '.venv/bin/jupyter', '.venv/bin/pip'} <= programs, programs


@pytest.mark.parametrize('words, installed', COMMANDS, ids=[' '.join(w) for w, _ in COMMANDS])
def test_readme_command_exists(words, installed):
    program, arguments = words[0], words[1:]
    if program == 'make':
        check_make_targets([a for a in arguments if not a.startswith('-') and '=' not in a])
    elif program.startswith('.venv/bin/'):
        check_venv_program(program.removeprefix('.venv/bin/'), arguments, installed)
    elif program in ('python', 'python3'):
        script = ROOT / arguments[0]
        assert script.is_file(), f'the README runs {arguments[0]}, which does not exist'
    else:
        assert shutil.which(program), f'the README runs {program}, which is not on the PATH'


def check_make_targets(targets):
    if shutil.which('make') is None:
        pytest.skip('make is not installed here')
    for target in targets:
        done = subprocess.run(['make', '-n', '-C', str(ROOT), target], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, f'make {target}: {done.stderr.strip()}'


def check_venv_program(name, arguments, installed):
    if name == 'pip' and arguments[:1] == ['install']:
        for found in INSTALL.finditer(shlex.join(['pip'] + arguments)):
            unknown = set(found[1].split(',')) - set(EXTRAS)
            assert not unknown, f'pyproject.toml has no extra {unknown}'
    program = f'jupyter-{arguments[0]}' if name == 'jupyter' and arguments else name
    if (VENV_BIN / program).exists():
        return
    missing_extras = sorted(extra for extra in installed if not extra_is_installed(extra))
    if missing_extras:
        pytest.skip(f'{program} comes with the extras the README installs before it, and '
                    f'{missing_extras} are not installed here')
    pytest.fail(f'the README runs .venv/bin/{name}, but {program} is not in {VENV_BIN} '
                f'although the extras {sorted(installed)} are installed')


def test_the_notebook_extra_brings_jupytext_into_jupyterlab():
    """`jupyter lab chapters/` opens a chapter's .md as a notebook only with Jupytext's
    JupyterLab extension and its server extension (the contents manager) in place."""
    if not extra_is_installed('notebook'):
        pytest.skip("the notebook extra is not installed here: pip install -e '.[notebook]'")
    share = pathlib.Path(sys.prefix) / 'share' / 'jupyter' / 'labextensions'
    assert (share / 'jupyterlab-jupytext' / 'package.json').is_file()
    config = pathlib.Path(sys.prefix) / 'etc' / 'jupyter' / 'jupyter_server_config.d'
    enabled = json.loads((config / 'jupytext.json').read_text())['ServerApp']
    assert enabled['jpserver_extensions'] == {'jupyterlab_jupytext': True}
