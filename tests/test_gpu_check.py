"""tests/run_chapter.py reads chapters as Jupytext does and runs them as a kernel would;
tests/gpu_check.py reports what it ran, or, without a GPU, what it would have run."""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import threading

import jupytext
import pytest
from hypothesis import given, strategies as st

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import gpu_check                                   # noqa: E402
import run_chapter                                 # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / 'chapters').glob('*.md'))

SAMPLE = textwrap.dedent('''\
    ---
    jupytext:
      formats: ipynb,md:myst
    ---
    # A chapter

    ```python
    print('a fenced block that is not a cell')
    ```

    ```{code-cell} ipython3
    from myst_nb import glue
    import matplotlib.pyplot as plt
    x = 41
    glue('answer', x + 1, display=False)
    glue('figure', plt.figure(), display=False)
    plt.plot([1, 2]); plt.show()
    %timeit x + 1
    x + 1
    ```

    ```{code-cell} ipython3
    :tags: [raises-exception]
    1 / 0
    ```

    ````{code-cell} ipython3
    ---
    tags: [remove-cell, another-tag]
    ---
    !echo skipped
    text = """
    ```
    """
    open('written.txt', 'w').write(str(len(plt.get_fignums())))
    ````

    ```{code-cell} ipython3
    :tags: [skip-execution]
    raise RuntimeError('never run')
    ```

    ```{code-cell} ipython3
    raise RuntimeError('the first real error')
    ```

    ```{code-cell} ipython3
    print('after the error')
    ```
    ''')


@pytest.mark.parametrize('markdown', CHAPTERS, ids=lambda p: p.stem)
def test_the_reader_finds_the_cells_jupytext_finds(markdown):
    expected = [(c.source.strip(), c.metadata.get('tags', []))
                for c in jupytext.read(markdown).cells if c.cell_type == 'code']
    found = [(source.strip(), tags) for _, source, tags in
             run_chapter.read_cells(markdown.read_text())]
    assert found == expected


def test_the_reader_reads_options_fences_and_tags():
    cells = run_chapter.read_cells(SAMPLE)
    assert [tags for _, _, tags in cells] == [[], ['raises-exception'],
                                             ['remove-cell', 'another-tag'],
                                             ['skip-execution'], [], []]
    assert '```' in cells[2][1] and cells[0][0] == 11      # line of the opening fence


def test_an_unclosed_cell_names_its_line():
    with pytest.raises(run_chapter.ChapterError, match='line 3 is never closed'):
        run_chapter.read_cells('text\n\n```{code-cell} ipython3\nx = 1\n')


def test_ipython_syntax_becomes_calls():
    assert run_chapter.translate('  %timeit f(x)') == \
        "  __ipython__.line_magic('timeit', 'f(x)')"
    assert run_chapter.translate('!ls -l') == "__ipython__.shell('ls -l')"
    assert run_chapter.translate('%%time\na = 1\nb = 2') == \
        "__ipython__.cell_magic('time', '', 'a = 1\\nb = 2')"


python_lines = st.text(st.characters(codec='ascii', exclude_characters='\n\r\x0b\x0c\x1c\x1d\x1e'),
                       max_size=30).filter(lambda line: not line.lstrip().startswith(('%', '!')))


@given(st.lists(python_lines, max_size=8).map('\n'.join))
def test_source_without_ipython_syntax_is_left_alone(source):
    assert run_chapter.translate(source) == source


def test_a_chapter_runs_in_its_folder_and_stops_at_the_first_error(tmp_path):
    chapter = tmp_path / 'sample.md'
    chapter.write_text(SAMPLE)
    done = subprocess.run([sys.executable, str(ROOT / 'tests' / 'run_chapter.py'), str(chapter),
                           '--json', 'result.json'], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 1, done.stderr
    result = json.loads((tmp_path / 'result.json').read_text())
    assert result['glued'] == {'answer': 42, 'figure': '<Figure>'}
    assert (result['cells'], result['ran'], result['error']['cell']) == (6, 3, 5)
    assert 'the first real error' in result['error']['traceback']
    assert (tmp_path / 'written.txt').read_text() == '0'     # plt.show() closed the figures
    assert '\n42\n' in done.stdout and 'µs per loop' in done.stdout
    assert 'ZeroDivisionError' in done.stdout and 'after the error' not in done.stdout


def test_without_a_gpu_the_check_runs_nothing_and_says_what_it_would_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, 'probe_gpu', lambda: (None, 'CuPy is not installed'))
    monkeypatch.setattr(gpu_check, 'run', lambda *args: pytest.fail('nothing may run'))
    assert gpu_check.main(['--report', str(tmp_path / 'report.md')]) == 0
    report = (tmp_path / 'report.md').read_text()
    assert report.startswith('# d2lperf GPU check: not run')
    assert 'No GPU was found: CuPy is not installed.' in report
    assert all(path.name in report for path in CHAPTERS)
    assert 'hybridize.py' in report and 'distributed.py' not in report   # no GPU rows there
    assert 'engine.py --gpu' in report and 'training.py gpu' in report
    assert '| `cupy` | `cupy-cuda12x or cupy-cuda13x` |' in report


def test_with_a_gpu_each_chapter_must_run_on_it(tmp_path, monkeypatch):
    """Here the chapter finds no GPU, so the check must fail it and say why."""
    chapter = tmp_path / 'chapters' / 'tiny.md'
    chapter.parent.mkdir()
    chapter.write_text('```{code-cell} ipython3\nimport d2lperf as d2l\n'
                       'from myst_nb import glue\nglue("n", 3, display=False)\n```\n')
    gpu = {'name': 'Stand-in GPU', 'count': 1, 'memory_gib': 80.0, 'compute_capability': '9.0',
           'cuda_runtime': 13000, 'cuda_driver': 13000, 'cupy': '14.0'}
    monkeypatch.setattr(gpu_check, 'probe_gpu', lambda: (gpu, None))
    monkeypatch.setattr(gpu_check, 'chapter_paths', lambda: [chapter])
    monkeypatch.setattr(gpu_check, 'missing_modules', lambda names: [])   # CuPy, say
    report_path = tmp_path / 'report.md'
    assert gpu_check.main(['--steps', 'chapters', '--quick', '--report', str(report_path)]) == 1
    report = report_path.read_text()
    assert report.startswith('# d2lperf GPU check: 1 FAILED')
    assert '- GPU: Stand-in GPU (1 visible), 80 GiB' in report
    assert '| chapter tiny | FAILED |' in report and 'ran on the CPU' in report
    assert '| n | 3 |' in report


def test_chapters_run_at_once_are_reported_in_order(tmp_path, monkeypatch):
    """With --jobs, chapters run side by side (the first one last to finish here); the report
    keeps the book's order, and every chapter ran once."""
    chapters = [tmp_path / f'{name}.md' for name in ('a', 'b', 'c', 'd')]
    ran, first_may_end = [], threading.Event()

    def run(command, timeout, quick, log_name):
        if log_name == 'chapter a':
            assert first_may_end.wait(10), 'the chapters ran one at a time'
        ran.append(log_name)
        if len(ran) == 3:
            first_may_end.set()
        return 0, f'output of {log_name}', 0.1
    monkeypatch.setattr(gpu_check, 'chapter_paths', lambda: chapters)
    monkeypatch.setattr(gpu_check, 'run', run)
    sections = gpu_check.check_chapters(argparse.Namespace(jobs=4, timeout=5, quick=True))
    assert [s['step'] for s in sections] == ['chapter a', 'chapter b', 'chapter c', 'chapter d']
    assert [s['output'] for s in sections] == [f'output of chapter {n}' for n in 'abcd']
    assert sorted(ran) == ['chapter a', 'chapter b', 'chapter c', 'chapter d']
    assert ran[-1] == 'chapter a'


def test_test_modules_are_left_out_only_for_packages_the_machine_lacks(tmp_path, monkeypatch):
    """The checkout's own `tests` package and d2lperf are there wherever the check runs; a
    module that imports a package this Python lacks is left out, and says which."""
    (tmp_path / 'tests').mkdir()
    (tmp_path / 'tests' / 'helpers.py').write_text('')
    (tmp_path / 'tests' / 'test_own.py').write_text(
        'from tests.helpers import x\nimport d2lperf\nimport helpers\n')
    (tmp_path / 'tests' / 'test_other.py').write_text('import numpy\nimport no_such_package\n')
    monkeypatch.setattr(gpu_check, 'ROOT', tmp_path)
    # As `python3 tests/gpu_check.py` runs: the checkout's root is not on its path.
    monkeypatch.setattr(sys, 'path', [p for p in sys.path
                                      if pathlib.Path(p or '.').resolve() != ROOT])
    monkeypatch.delitem(sys.modules, 'tests', raising=False)
    assert gpu_check.test_modules_lacking_imports() == {
        tmp_path / 'tests' / 'test_other.py': ['no_such_package']}


def test_benchmarks_with_a_gpu_only_mode_run_in_it(monkeypatch):
    commands = []
    monkeypatch.setattr(gpu_check, 'run', lambda command, *args: (
        commands.append(command[1:]), (0, '| what |\n|---|\n| gpu(0): x |\n', 1.0))[1])
    sections = gpu_check.check_benchmarks(argparse.Namespace(timeout=5, quick=True))
    ran = {pathlib.Path(command[0]).name: command[1:] for command in commands}
    assert ran['engine.py'] == ['--gpu'] and ran['training.py'] == ['gpu']
    assert ran['hybridize.py'] == []
    assert all(section['ok'] for section in sections)


def test_benchmark_gpu_rows_keep_their_table_header():
    output = ('# header\n| device | mode | µs |\n|---|---|--:|\n| cpu | eager | 1 |\n'
              '| gpu | eager | 2 |\n| cpu + gpu(0) | both | 3 |\ntext\n\n'
              '| what | img/s |\n|---|--:|\n| cpu | 5 |\n\n| what | img/s |\n|--|--|\n'
              '| on gpu(0) | 7 |')
    assert gpu_check.gpu_tables(output) == [
        ['| device | mode | µs |', '|---|---|--:|', '| gpu | eager | 2 |',
         '| cpu + gpu(0) | both | 3 |'],
        ['| what | img/s |', '|--|--|', '| on gpu(0) | 7 |']]
    assert gpu_check.gpu_tables('| a |\n|---|\n| cpu |\n') == []


def test_a_fence_in_the_output_cannot_close_the_report_block():
    block = gpu_check.fenced('before\n````\nafter')
    assert block.startswith('`````text\n') and block.endswith('\n`````')


def test_the_cudnn_step_counts_the_cases_of_each_section_table(monkeypatch):
    """tests/cudnn_check.py prints a table a section (convolution, attention, batch norm):
    the report keeps them apart and counts their rows, not their header lines."""
    output = '\n'.join([
        'Convolutions, cuDNN against im2col:', '| case | ok |', '|---|---|',
        '| conv1 | ok |', '| layer1 | FAILED |', '',
        'Attention in float16, forward and backward:', '| case | ok |', '|---|---|',
        '| gpt | ok |', "cuDNN settings: {'path': 'cuDNN graphs'}"])
    monkeypatch.setattr(gpu_check, 'run', lambda *args: (1, output, 2.0))
    section = gpu_check.check_cudnn(argparse.Namespace(timeout=60, quick=True))
    assert section['notes'][0] == '3 case(s), 1 failed'
    assert [len(t) for t in section['tables']] == [4, 3]
    assert not section['ok'] and section['notes'][1].startswith('cuDNN settings')
