"""Run a chapter's code as a plain Python program: no Jupyter, no Jupytext, no notebook server.

    python tests/run_chapter.py chapters/hybridize.md [--json result.json]

The chapter's MyST Markdown is the source: its code cells are read straight from it and run
in order in one namespace, in the chapter's folder, as a notebook kernel would run them. Each
cell's printed output follows a `--- cell N (line L)` banner, and a cell that ends in an
expression prints its value, as in a notebook. `make gpu-check` runs every chapter this way.

What only IPython understands is translated: `%time` and `%timeit` (lines or whole cells),
`%matplotlib` (nothing to do), `!command` (skipped, with a note). `plt.show()` closes the
figures, since there is no screen. myst-nb's `glue` is replaced by a stand-in that records
each glued value, so that a report can show the numbers the prose would print. Cells tagged
`skip-execution` are skipped; a cell tagged `raises-exception` may raise. The first other
error ends the run, since later cells build on earlier ones.
"""
import argparse
import ast
import json
import linecache
import os
import pathlib
import re
import sys
import time
import timeit
import traceback
import types

OPENING = re.compile(r'^(?P<fence>`{3,}|~{3,})\{code-cell\}')
MAGIC = re.compile(r'^(?P<indent>\s*)%(?P<name>\w+)\s*(?P<rest>.*)$')
SHELL = re.compile(r'^(?P<indent>\s*)!(?P<command>.*)$')


class ChapterError(ValueError):
    """The Markdown cannot be read as a MyST chapter."""


def read_cells(text):
    """[(line number, source, tags)] of every code cell of a MyST Markdown text."""
    lines, cells, number = text.splitlines(), [], 0
    while number < len(lines):
        opening = OPENING.match(lines[number])
        number += 1
        if not opening:
            continue
        start, fence = number, opening['fence']
        options, number = _read_options(lines, number)
        body = []
        while number < len(lines) and lines[number].strip() != fence:
            body.append(lines[number])
            number += 1
        if number == len(lines):
            raise ChapterError(f'the code cell opened on line {start} is never closed '
                               f'(no line holding only {fence})')
        number += 1
        cells.append((start, '\n'.join(body), _tags(options, start)))
    return cells


def _read_options(lines, number):
    """A cell's options: `:key: value` lines, or a `---` YAML block of `key: value` lines."""
    options = {}
    if number < len(lines) and lines[number].strip() == '---':
        end = number + 1
        while end < len(lines) and lines[end].strip() != '---':
            key, _, value = lines[end].partition(':')
            options[key.strip()] = value.strip()
            end += 1
        return options, end + 1
    while number < len(lines) and (option := re.match(r'^:(\w[\w-]*):\s*(.*)$', lines[number])):
        options[option[1]] = option[2].strip()
        number += 1
    return options, number


def _tags(options, line):
    value = options.get('tags', '')
    if not value:
        return []
    if not (value.startswith('[') and value.endswith(']')):
        raise ChapterError(f'line {line}: write tags as a list, e.g. :tags: [remove-cell]')
    return [tag.strip().strip('\'"') for tag in value[1:-1].split(',') if tag.strip()]


def translate(source):
    """Python source for a cell written for IPython: magics and shell escapes become calls."""
    lines = source.split('\n')
    if lines and lines[0].startswith('%%'):
        name, _, rest = lines[0][2:].partition(' ')
        body = '\n'.join(lines[1:])
        return f'__ipython__.cell_magic({name!r}, {rest.strip()!r}, {body!r})'
    out = []
    for line in lines:
        if magic := MAGIC.match(line):
            out.append(f'{magic["indent"]}__ipython__.line_magic({magic["name"]!r}, '
                       f'{magic["rest"]!r})')
        elif shell := SHELL.match(line):
            out.append(f'{shell["indent"]}__ipython__.shell({shell["command"].strip()!r})')
        else:
            out.append(line)
    return '\n'.join(out)


class IPythonStandIn:
    """The few IPython features chapters may use, for a namespace without IPython."""

    def __init__(self, namespace):
        self.namespace = namespace

    def line_magic(self, name, rest):
        if name == 'matplotlib':
            return None
        if name == 'time':
            start = time.perf_counter()
            value = self._run(rest)
            print(f'Wall time: {(time.perf_counter() - start) * 1e3:.3f} ms')
            return value
        if name == 'timeit':
            return self._timeit(rest)
        raise NotImplementedError(f'%{name} is not supported outside IPython; '
                                  f'tests/run_chapter.py knows %time, %timeit and %matplotlib')

    def cell_magic(self, name, rest, body):
        if name not in ('time', 'timeit'):
            raise NotImplementedError(f'%%{name} is not supported outside IPython; '
                                      f'tests/run_chapter.py knows %%time and %%timeit')
        return self.line_magic(name, body)

    def shell(self, command):
        print(f'(shell command skipped outside IPython: !{command})')

    def _run(self, code):
        tree = ast.parse(code)
        if len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr):
            return eval(compile(ast.Expression(tree.body[0].value), '<magic>', 'eval'),
                        self.namespace)
        exec(compile(tree, '<magic>', 'exec'), self.namespace)
        return None

    def _timeit(self, code):
        timer = timeit.Timer(code, globals=self.namespace)
        number, _ = timer.autorange()
        best = min(timer.repeat(repeat=3, number=number)) / number
        print(f'{best * 1e6:.3f} µs per loop (best of 3 runs, {number} loops each)')


def glue_stand_in(glued):
    """A module that takes the place of myst_nb: `glue` records values instead of showing them."""
    module = types.ModuleType('myst_nb')

    def glue(name, variable, display=True):
        if type(variable).__name__ == 'Markdown':        # a glued verdict: its text
            variable = variable.data
        glued[name] = (variable if isinstance(variable, (int, float, str, bool)) else
                       float(variable) if hasattr(variable, '__float__') else
                       f'<{type(variable).__name__}>')
        if display:
            print(repr(variable))
    module.glue = glue
    return module


def ipython_display_stand_in():
    """Where IPython is not installed (a GPU machine's bare Python): `IPython.display`'s
    Markdown and display, enough for the chapters' glued verdicts and tables."""
    try:
        import IPython.display   # noqa: F401
        return
    except ImportError:
        pass

    class Markdown:
        def __init__(self, data):
            self.data = data

        def __repr__(self):
            return self.data

    display_module = types.ModuleType('IPython.display')
    display_module.Markdown = display_module.HTML = Markdown
    display_module.display = lambda *objects, **kwargs: print(*map(repr, objects))
    # Only the submodule: a module named IPython would tell matplotlib that it runs inside one.
    sys.modules['IPython.display'] = display_module


def quiet_matplotlib():
    """Draw off screen; `plt.show()` has nothing to show on, so it closes the figures."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    plt.show = lambda *args, **kwargs: plt.close('all')


def run_cell(source, namespace, filename):
    """Execute a cell; print the value of a final expression, as a notebook shows it."""
    code = translate(source)
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    tree = ast.parse(code, filename)
    last = tree.body[-1] if tree.body else None
    if isinstance(last, ast.Expr) and not source.rstrip().endswith(';'):
        exec(compile(ast.Module(tree.body[:-1], []), filename, 'exec'), namespace)
        value = eval(compile(ast.Expression(last.value), filename, 'eval'), namespace)
        if value is not None:
            print(repr(value))
    else:
        exec(compile(tree, filename, 'exec'), namespace)


def run_chapter(path):
    """Run every cell of the chapter at `path`; returns what happened, for a report."""
    path = pathlib.Path(path).resolve()
    cells, glued = read_cells(path.read_text()), {}
    sys.modules['myst_nb'] = glue_stand_in(glued)
    ipython_display_stand_in()
    quiet_matplotlib()
    namespace = {'__name__': '__main__', '__builtins__': __builtins__}
    namespace['__ipython__'] = IPythonStandIn(namespace)
    os.chdir(path.parent)
    result = {'chapter': path.stem, 'cells': len(cells), 'ran': 0, 'glued': glued,
              'error': None}
    start = time.perf_counter()
    for index, (line, source, tags) in enumerate(cells, 1):
        print(f'--- cell {index} (line {line}){" " + str(tags) if tags else ""}', flush=True)
        if 'skip-execution' in tags:
            print('(skipped: tagged skip-execution)')
            continue
        try:
            run_cell(source, namespace, f'<{path.stem} cell {index}, line {line}>')
        except Exception:              # noqa: BLE001 - reported, like a notebook would
            if 'raises-exception' in tags:
                traceback.print_exc(limit=-3, file=sys.stdout)
            else:
                result['error'] = {'cell': index, 'line': line,
                                   'traceback': traceback.format_exc(limit=-8)}
                print(result['error']['traceback'], flush=True)
                break
        finally:
            sys.stdout.flush()
            if 'matplotlib.pyplot' in sys.modules:
                sys.modules['matplotlib.pyplot'].close('all')
        result['ran'] += 1
    result['seconds'] = time.perf_counter() - start
    result['device'] = _device_used()
    return result


def _device_used():
    """Where `d2l.try_gpu()` puts the chapter's arrays, if the chapter used d2lperf."""
    d2l = sys.modules.get('d2lperf')
    return repr(d2l.try_gpu()) if d2l is not None else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('chapter', help='a chapter in MyST Markdown, e.g. chapters/hardware.md')
    parser.add_argument('--json', help='write what happened to this file, as JSON')
    args = parser.parse_args()
    target = pathlib.Path(args.json).resolve() if args.json else None   # before the chdir
    result = run_chapter(args.chapter)
    if target:
        partial = target.with_name(target.name + '.partial')
        partial.write_text(json.dumps(result, indent=1))
        os.replace(partial, target)
    status = 'ok' if result['error'] is None else f'failed in cell {result["error"]["cell"]}'
    print(f'=== {result["chapter"]}: {result["ran"]} of {result["cells"]} cells ran, {status}, '
          f'{result["seconds"]:.1f} s', flush=True)
    return 0 if result['error'] is None else 1


if __name__ == '__main__':
    sys.exit(main())
