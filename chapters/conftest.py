"""Keep what the notebook run computed, so that the book's build need not compute it again.

`make test` runs every chapter's cells under nbval, in one kernel each, as the book's build
runs them. Where every cell of a chapter passes, its outputs are written (atomically) to
`_build/executed/NAME.ipynb`, stamped with what produced them: the chapter, every file of the
package, and `D2LPERF_QUICK` (`_ext/executed.py`'s `stamp`). The book's build (`_ext/executed.py`) takes a
chapter's outputs from there while the stamp still matches, and runs the chapter itself
otherwise; in CI that saves one run of every chapter.

nbval keeps each cell's outputs for its own comparison, but drops the messages it does not
compare (a display updated in place, an output cleared), so the kernel's messages are read
here and turned into outputs by nbclient, the library the book's build executes with.
"""
import copy
import os
import pathlib
import sys

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / '_ext'))
from executed import EXECUTED, stamp     # noqa: E402  (the book's build checks the same stamp)


class ExecutedNotebook:
    """One chapter's notebook, filled in with its outputs cell by cell as nbval runs them."""

    def __init__(self, source):
        from nbclient import NotebookClient
        self.source = source
        self.notebook = copy.deepcopy(source.nb)
        for cell in self.notebook.cells:
            if cell.cell_type == 'code':
                cell.outputs, cell.execution_count = [], None
        self.client = NotebookClient(self.notebook, record_timing=False)   # its handling of messages
        self.messages = []
        self.passed = self.failed = 0
        read = source.get_kernel_message           # every message nbval reads passes here

        def reading(timeout=None, stream='iopub'):
            message = read(timeout=timeout, stream=stream)
            if stream == 'iopub':
                self.messages.append(message)
            return message
        source.get_kernel_message = reading

    def add(self, item):
        """Turn the messages of the cell just run into its outputs."""
        from nbclient.exceptions import CellExecutionComplete
        index = next(i for i, cell in enumerate(self.source.nb.cells) if cell is item.cell)
        cell, messages, self.messages = self.notebook.cells[index], self.messages, []
        request = next((m['parent_header'].get('msg_id') for m in messages
                        if m['msg_type'] == 'execute_input'), None)
        self.client.clear_before_next_output = False       # as nbclient starts a cell
        for message in messages:
            if message['parent_header'].get('msg_id') != request:
                continue
            try:
                self.client.process_message(message, cell, index)
            except CellExecutionComplete:
                break
        self.passed += 1
        # numbered as a fresh kernel numbers them (nbval's requests are not all counted)
        for output in [cell] + [o for o in cell.outputs if 'execution_count' in o]:
            output.execution_count = self.passed

    def complete(self):
        code = sum(cell.cell_type == 'code' for cell in self.notebook.cells)
        return self.failed == 0 and self.passed == code

    def save(self):
        chapter = pathlib.Path(self.source.fspath).stem
        self.notebook.metadata['d2lperf_executed'] = {'stamp': stamp(chapter)}
        EXECUTED.mkdir(parents=True, exist_ok=True)
        partial = EXECUTED / f'.{chapter}.ipynb.partial'
        nbformat.write(self.notebook, str(partial))
        os.replace(partial, EXECUTED / f'{chapter}.ipynb')


def is_chapter_cell(item):
    path = pathlib.Path(item.parent.fspath)
    return (type(item).__name__ == 'IPyNbCell' and path.parent == ROOT / 'chapters'
            and path.with_suffix('.md').exists())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if not is_chapter_cell(item):
        yield
        return
    notebook = item.parent.__dict__.get('executed')
    if notebook is None:
        notebook = item.parent.executed = ExecutedNotebook(item.parent)
    notebook.messages = []
    outcome = yield
    if outcome.excinfo is not None:
        notebook.failed += 1
        return
    try:
        notebook.add(item)
    except Exception as error:         # keeping outputs must never fail a cell: the book runs it
        notebook.failed += 1
        item.warn(pytest.PytestWarning(f'outputs not kept for the book ({error!r})'))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a chapter's last cell: save its outputs if every cell passed."""
    yield
    if is_chapter_cell(item) and (nextitem is None or nextitem.parent is not item.parent):
        notebook = item.parent.__dict__.get('executed')
        if notebook is not None and notebook.complete():
            try:
                notebook.save()
            except Exception as error:     # as above: the book's build then runs the chapter
                item.warn(pytest.PytestWarning(f'outputs not kept for the book ({error!r})'))
