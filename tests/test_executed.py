"""The book built from the outputs of the notebook run (chapters/conftest.py, _ext/executed.py):
outputs rebuilt from the kernel's messages as nbclient builds them, taken only while the stamp
matches and only into the chapter whose code cells they came from."""
import importlib.util
import pathlib
import sys

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / '_ext'))
import executed   # noqa: E402


def load_recorder():
    path = ROOT / 'chapters' / 'conftest.py'
    spec = importlib.util.spec_from_file_location('chapters_conftest', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def message(kind, content, request='run-1'):
    return {'msg_type': kind, 'content': content, 'parent_header': {'msg_id': request},
            'header': {'msg_type': kind}, 'metadata': {}}


class FakeFile:
    """nbval's notebook file: its notebook, and the kernel messages it reads."""
    def __init__(self, notebook, messages):
        self.nb, self.fspath, self.queue = notebook, 'chapters/x.ipynb', list(messages)

    def get_kernel_message(self, timeout=None, stream='iopub'):
        return self.queue.pop(0)


class FakeCell:
    def __init__(self, parent, cell):
        self.parent, self.cell = parent, cell


def test_a_display_updated_in_place_and_a_cleared_output_are_kept_as_the_book_shows_them():
    """nbval drops update_display_data and clear_output: an animated figure would have kept
    its first frame, and a cleared line would have stayed."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_markdown_cell('text'),
                      nbformat.v4.new_code_cell('animate()')]
    messages = [
        message('status', {'execution_state': 'busy'}),
        message('execute_input', {'code': 'animate()', 'execution_count': 7}),
        message('stream', {'name': 'stdout', 'text': 'epoch 1\n'}, request='other'),
        message('display_data', {'data': {'text/plain': 'frame 1'}, 'metadata': {},
                                 'transient': {'display_id': 'fig'}}),
        message('update_display_data', {'data': {'text/plain': 'frame 9'}, 'metadata': {},
                                        'transient': {'display_id': 'fig'}}),
        message('stream', {'name': 'stdout', 'text': 'training...\n'}),
        message('clear_output', {'wait': True}),
        message('stream', {'name': 'stdout', 'text': 'done\n'}),
        message('status', {'execution_state': 'idle'})]
    source = FakeFile(notebook, messages)
    kept = load_recorder().ExecutedNotebook(source)
    while source.queue:
        source.get_kernel_message()
    kept.add(FakeCell(source, notebook.cells[1]))
    cell = kept.notebook.cells[1]
    assert [(o.output_type, o.get('text') or o.data['text/plain']) for o in cell.outputs] == [
        ('stream', 'done\n')]
    assert cell.execution_count == 1 and kept.complete()
    assert notebook.cells[1].outputs == [], 'the source notebook is left as it was'


def test_the_frame_updated_in_place_is_the_one_kept():
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell('animate()')]
    messages = [
        message('execute_input', {'code': 'animate()', 'execution_count': 1}),
        message('display_data', {'data': {'text/plain': 'frame 1'}, 'metadata': {},
                                 'transient': {'display_id': 'fig'}}),
        message('update_display_data', {'data': {'text/plain': 'frame 9'}, 'metadata': {},
                                        'transient': {'display_id': 'fig'}}),
        message('status', {'execution_state': 'idle'})]
    source = FakeFile(notebook, messages)
    kept = load_recorder().ExecutedNotebook(source)
    while source.queue:
        source.get_kernel_message()
    kept.add(FakeCell(source, notebook.cells[0]))
    assert [o.data['text/plain'] for o in kept.notebook.cells[0].outputs] == ['frame 9']


def chapter_with(*sources):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_markdown_cell('# A chapter')]
    notebook.cells += [nbformat.v4.new_code_cell(source) for source in sources]
    return notebook


def test_outputs_go_only_into_the_code_cells_they_came_from():
    kept = chapter_with('x = 1', 'print(x)')
    kept.cells[2].outputs = [nbformat.v4.new_output('stream', name='stdout', text='1\n')]
    read = executed.with_outputs(chapter_with('x = 1', 'print(x)\n'), kept)
    assert read.cells[2].outputs[0].text == '1\n'
    assert executed.with_outputs(chapter_with('x = 2', 'print(x)'), kept) is None
    assert executed.with_outputs(chapter_with('x = 1'), kept) is None


def test_a_stale_stamp_means_the_chapter_is_executed_again(tmp_path, monkeypatch):
    monkeypatch.setattr(executed, 'EXECUTED', tmp_path)
    chapter = 'hardware'
    notebook = chapter_with('1 + 1')
    notebook.metadata['d2lperf_executed'] = {'stamp': executed.stamp(chapter)}
    nbformat.write(notebook, str(tmp_path / f'{chapter}.ipynb'))
    assert executed.current_outputs(chapter) is not None
    monkeypatch.setenv('D2LPERF_QUICK', 'other')     # another mode: other outputs
    assert executed.current_outputs(chapter) is None
    assert executed.current_outputs('no_such_chapter') is None


@pytest.mark.parametrize('changed', ['d2lperf/__init__.py', 'chapters/hardware.md'])
def test_the_stamp_follows_the_package_and_the_chapter(changed, monkeypatch, tmp_path):
    copy = tmp_path / 'root'
    for part in ('d2lperf/__init__.py', 'chapters/hardware.md', 'chapters/hardware.ipynb'):
        (copy / part).parent.mkdir(parents=True, exist_ok=True)
        (copy / part).write_bytes((ROOT / part).read_bytes())
    monkeypatch.setattr(executed, 'ROOT', copy)
    before = executed.stamp('hardware')
    with open(copy / changed, 'a') as file:
        file.write('\n')
    assert executed.stamp('hardware') != before
