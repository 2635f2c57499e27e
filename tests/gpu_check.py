"""Run everything GPU-specific in d2lperf on gpu(0) and write one report: `make gpu-check`.

    python3 tests/gpu_check.py [--quick] [--report gpu-check-report.md] [--steps unit ...]
                               [--jobs 4]
    python3 tests/gpu_check.py --fetch-wheels    # beforehand, on a machine with an index

Made for a bare GPU machine: Python >= 3.10 with NumPy and CuPy (cupy-cuda12x or
cupy-cuda13x), and no Jupyter, no notebook server, no network, no package index. The checkout
is all it needs besides those; what else it can use is listed in the report (`REQUIREMENTS`).
Each step runs in a fresh interpreter with the checkout first on the path:

* cudnn: cuDNN's convolutions against im2col on gpu(0), errors and times
  (tests/cudnn_check.py); fails where convolutions did not run through cuDNN graphs;
* unit: the whole unit suite under pytest, so that every CuPy-guarded test runs on the GPU
  (the guards open) next to the rest; needs pytest and hypothesis;
* chapters: every chapters/*.md, cell by cell, with tests/run_chapter.py: `d2l.try_gpu()`
  returns gpu(0), so the chapters compute there; the report keeps each chapter's output and
  the values it glues into its prose;
* benchmarks: every benchmarks/*.py that has GPU rows (those rows alone where the script can
  run them so: `GPU_ONLY_ARGUMENTS`); the report shows those rows.

Without a GPU it runs nothing and says so, and what it would have run.

The cuDNN frontend (nvidia-cudnn-frontend, pinned in pyproject.toml) travels as wheels, for
a machine with no package index: `--fetch-wheels` downloads them into .gpu-wheels/ (git
ignores it; carry it with the checkout), one for each Python the machine may have. Where
the frontend does not import, the wheel for this Python is unpacked under _build/ and put on
every step's path: nothing is installed into the machine's Python. cuDNN's runtime is not
carried (it is about 1 GB): the machines we measure on have it, installed with PyTorch.
"""
import argparse
import ast
import concurrent.futures
import datetime
import importlib.util
import json
import os
import pathlib
import platform
import re
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = ('cudnn', 'unit', 'chapters', 'benchmarks')
WHEELS = ROOT / '.gpu-wheels'
WHEEL_PYTHONS = ('3.10', '3.11', '3.12', '3.13')
# module: (what to install, which steps need it)
REQUIREMENTS = {
    'numpy': ('numpy', 'all'),
    'cupy': ('cupy-cuda12x or cupy-cuda13x', 'all'),
    'matplotlib': ('matplotlib', 'all (d2lperf imports it)'),
    'psutil': ('psutil', 'all (d2lperf imports it)'),
    'threadpoolctl': ('threadpoolctl', 'all (d2lperf imports it)'),
    'ml_dtypes': ('ml_dtypes', 'all (d2lperf imports it: bfloat16)'),
    'pytest': ('pytest', 'unit'),
    'hypothesis': ('hypothesis', 'unit'),
    'sklearn': ('scikit-learn', 'chapters that train on images, offline (the data fallback)'),
    'torch': ('torch', 'optional: the PyTorch rows of the benchmarks'),
    'cudnn': ('nvidia-cudnn-frontend (pyproject.toml pins it; or --fetch-wheels to carry it)',
              'optional: convolutions as cuDNN graphs (else im2col); the cudnn step'),
    'jupytext': ('jupytext', 'optional: tests/test_chapters.py (Markdown/notebook pairing)'),
    'yaml': ('pyyaml', 'optional: tests/test_chapters.py'),
}
NEEDED = {'cudnn': ['numpy', 'cupy', 'matplotlib', 'psutil', 'threadpoolctl', 'ml_dtypes'],
          'unit': ['numpy', 'cupy', 'matplotlib', 'psutil', 'threadpoolctl', 'ml_dtypes',
                   'pytest', 'hypothesis'],
          'chapters': ['numpy', 'cupy', 'matplotlib', 'psutil', 'threadpoolctl', 'ml_dtypes'],
          'benchmarks': ['numpy', 'cupy', 'matplotlib', 'psutil', 'threadpoolctl', 'ml_dtypes']}
GPU_PROBE = """
import json, cupy
runtime = cupy.cuda.runtime
props = runtime.getDeviceProperties(0)
print(json.dumps({'count': runtime.getDeviceCount(), 'name': props['name'].decode(),
                  'memory_gib': props['totalGlobalMem'] / 2 ** 30,
                  'compute_capability': f"{props['major']}.{props['minor']}",
                  'cuda_runtime': runtime.runtimeGetVersion(),
                  'cuda_driver': runtime.driverGetVersion(), 'cupy': cupy.__version__}))
"""


def probe_gpu():
    """(facts about gpu(0), None) or (None, why there is no GPU), asked of a fresh interpreter."""
    if importlib.util.find_spec('cupy') is None:
        return None, 'CuPy is not installed (pip install cupy-cuda12x, or cupy-cuda13x)'
    done = subprocess.run([sys.executable, '-c', GPU_PROBE], capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ['no message'])[-1]
        return None, f'CuPy is installed but found no usable GPU: {last}'
    return json.loads(done.stdout), None


def missing_modules(names):
    return [name for name in names if importlib.util.find_spec(name) is None]


def say(line):
    """One line to stdout in one write: chapters run side by side (--jobs) must not
    interleave their lines."""
    sys.stdout.write(line + '\n')
    sys.stdout.flush()


def frontend_paths():
    """{PYTHONPATH, LD_LIBRARY_PATH} that put the checkout, the carried frontend and cuDNN's
    runtime before what the environment has; `--environment` prints them for a shell."""
    carried = [str(carried_frontend())] if carried_frontend() else []
    paths = [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
    env = {'PYTHONPATH': os.pathsep.join([str(ROOT)] + carried + paths)}
    libraries = cudnn_runtime_dirs() + [p for p in os.environ.get(
        'LD_LIBRARY_PATH', '').split(os.pathsep) if p]
    if libraries:
        env['LD_LIBRARY_PATH'] = os.pathsep.join(dict.fromkeys(libraries))
    return env


def run(command, timeout, quick, log_name):
    """Run a command from the checkout's root; returns (exit status, output, seconds)."""
    env = dict(os.environ, **frontend_paths(), MPLBACKEND='Agg', PYTHONUNBUFFERED='1')
    env.pop('D2LPERF_QUICK', None)
    if quick:
        env['D2LPERF_QUICK'] = '1'
    say(f'[gpu-check] {log_name}: {" ".join(map(str, command))}')
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        status, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b'').decode(errors='replace') if isinstance(
            expired.stdout, bytes) else (expired.stdout or '')
        status, output = 'timeout', output + f'\n(stopped after {timeout} s)'
    seconds = time.perf_counter() - start
    say(f'[gpu-check] {log_name}: {"ok" if status == 0 else status} in {seconds:.0f} s')
    return status, output, seconds


def frontend_requirement():
    """The pinned frontend, as pyproject.toml's gpu extra names it: one place for the pin."""
    text = (ROOT / 'pyproject.toml').read_text()
    return re.search(r'"(nvidia-cudnn-frontend==[^"]+)"', text).group(1)


def fetch_wheels():
    """Download the pinned frontend's wheel for each Python in WHEEL_PYTHONS into WHEELS."""
    for version in WHEEL_PYTHONS:
        status = subprocess.run(
            [sys.executable, '-m', 'pip', 'download', frontend_requirement(), '--no-deps',
             '--only-binary=:all:', '--python-version', version,
             '--platform', f'manylinux_2_28_{platform.machine()}', '-d', str(WHEELS)]).returncode
        if status:
            return status
    print(f'[gpu-check] wheels in {WHEELS}: '
          + ', '.join(sorted(p.name for p in WHEELS.glob('*.whl'))))
    return 0


def carried_frontend():
    """Where the carried wheel for this Python is unpacked, or None: the frontend imports
    already, or no wheel for this Python and machine was carried."""
    if 'cudnn' in sys.modules or importlib.util.find_spec('cudnn') is not None:
        return None
    tag = f'cp{sys.version_info.major}{sys.version_info.minor}'
    pattern = f'nvidia_cudnn_frontend-*-{tag}-{tag}-*{platform.machine()}.whl'
    wheels = sorted(WHEELS.glob(pattern))
    if not wheels:
        return None
    target = ROOT / '_build' / 'gpu-wheels' / wheels[-1].stem
    if not (target / 'cudnn').is_dir():
        with zipfile.ZipFile(wheels[-1]) as wheel:
            wheel.extractall(target)
    return target


def cudnn_runtime_dirs():
    """The folders of cuDNN's runtime (libcudnn.so.9) among this Python's packages, where
    pip put it for PyTorch (nvidia-cudnn-cu12 or -cu13): the frontend reads LD_LIBRARY_PATH
    first, so a layout its own search misses is still found."""
    found = []
    for root in dict.fromkeys([sysconfig.get_path('purelib'), sysconfig.get_path('platlib')]):
        for pattern in ('nvidia/*/lib/libcudnn.so.9', 'nvidia/*/*/lib/libcudnn.so.9'):
            found += [str(path.parent) for path in sorted(pathlib.Path(root).glob(pattern))]
    return list(dict.fromkeys(found))


def unit_command(ignored=()):
    return ([sys.executable, '-m', 'pytest', '-q', '-rfEs', '-p', 'no:cacheprovider']
            + [f'--ignore={path.relative_to(ROOT)}' for path in ignored]
            # pip installs into a fresh venv from PyPI, which a GPU machine may not reach
            + ['--deselect', 'tests/test_install_cell.py::'
               'test_the_cell_installs_d2lperf_from_a_clone_into_a_fresh_venv', 'tests'])


def test_modules_lacking_imports():
    """{test module: [modules it imports that this Python lacks]}, for the modules that lack
    some: tests/test_chapters.py, say, needs Jupytext, which a bare GPU box has no need for."""
    lacking = {}
    for path in sorted((ROOT / 'tests').glob('test_*.py')):
        names = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names.update(alias.name.split('.')[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split('.')[0])
        local = {name for name in names if name in ('d2lperf', 'tests') or
                 (ROOT / 'tests' / f'{name}.py').exists() or (ROOT / 'tests' / name).is_dir()}
        if missing := missing_modules(sorted(names - local)):
            lacking[path] = missing
    return lacking


def chapter_paths():
    return sorted((ROOT / 'chapters').glob('*.md'))


# Scripts whose GPU rows run alone given these arguments: their CPU sections (training.py's
# ResNet-18 against PyTorch on the CPU, say) take minutes of a lease that is short.
GPU_ONLY_ARGUMENTS = {'engine.py': ['--gpu'], 'training.py': ['gpu']}


def gpu_benchmarks():
    """The benchmark scripts that have rows for a GPU."""
    return [path for path in sorted((ROOT / 'benchmarks').glob('*.py'))
            if re.search(r'num_gpus\(\)|gpu\(0\)', path.read_text())]


def benchmark_command(path):
    return [sys.executable, str(path)] + GPU_ONLY_ARGUMENTS.get(path.name, [])


def check_unit(args):
    lacking = test_modules_lacking_imports()
    status, output, seconds = run(unit_command(lacking), args.timeout, args.quick, 'unit tests')
    summary = re.findall(r'^=*\s*(\d+ (?:passed|failed).*?)\s*=*$', output, re.M)
    gpu_skips = [line for line in output.splitlines()
                 if line.startswith('SKIPPED') and re.search(r'needs a GPU|GPU and CuPy', line)]
    notes = [f'pytest: {summary[-1] if summary else "no summary line"}']
    notes += [f'{path.relative_to(ROOT)} not run: it imports {", ".join(missing)}'
              for path, missing in lacking.items()]
    if gpu_skips:
        notes.append(f'{len(gpu_skips)} GPU test(s) were skipped: the tests saw no GPU')
    return {'step': 'unit tests', 'ok': status == 0 and not gpu_skips, 'seconds': seconds,
            'notes': notes, 'output': output}


def check_cudnn(args):
    status, output, seconds = run([sys.executable, str(ROOT / 'tests' / 'cudnn_check.py')],
                                  args.timeout, args.quick, 'cuDNN against im2col')
    tables = [[]]                       # a table a section: convolution, attention, batch norm
    for line in output.splitlines():
        if line.startswith('|'):
            tables[-1].append(line)
        elif tables[-1]:
            tables.append([])
    tables = [t for t in tables if t]
    rows = [line for t in tables for line in t[2:]]          # below each header and its rule
    notes = [f'{len(rows)} case(s), {sum(r.endswith("| FAILED |") for r in rows)} failed']
    notes += [line for line in output.splitlines() if line.startswith('cuDNN settings')]
    return {'step': 'cuDNN against im2col', 'ok': status == 0, 'seconds': seconds,
            'notes': notes, 'tables': tables, 'output': output}


def check_chapter(path, args):
    with tempfile.TemporaryDirectory() as folder:
        result_file = pathlib.Path(folder) / 'result.json'
        status, output, seconds = run(
            [sys.executable, str(ROOT / 'tests' / 'run_chapter.py'), str(path),
             '--json', str(result_file)], args.timeout, args.quick, f'chapter {path.stem}')
        result = json.loads(result_file.read_text()) if result_file.exists() else None
    return chapter_section(path.stem, status, output, seconds, result)


def check_chapters(args):
    """Each chapter in its own interpreter, `args.jobs` at a time: a GPU machine's lease is
    short, and most chapters leave its cores idle while they wait for the GPU."""
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        return list(pool.map(lambda path: check_chapter(path, args), chapter_paths()))


def chapter_section(name, status, output, seconds, result):
    if result is None:
        notes = [f'did not finish (exit status {status})']
    else:
        notes = [f'{result["ran"]} of {result["cells"]} cells ran; arrays on '
                 f'{result["device"]}']
        if result['error']:
            notes.append(f'failed in cell {result["error"]["cell"]} (line '
                         f'{result["error"]["line"]} of chapters/{name}.md)')
    on_gpu = result is not None and str(result['device']).startswith('gpu')
    if result is not None and not on_gpu:
        notes.append('d2l.try_gpu() did not return a GPU: the chapter ran on the CPU')
    glued = result['glued'] if result else {}
    return {'step': f'chapter {name}', 'ok': status == 0 and on_gpu, 'seconds': seconds,
            'notes': notes, 'glued': glued, 'output': output}


def check_benchmarks(args):
    sections = []
    for path in gpu_benchmarks():
        status, output, seconds = run(benchmark_command(path), args.timeout, args.quick,
                                      f'benchmark {path.name}')
        tables = gpu_tables(output)
        notes = [f'{sum(len(table) - 2 for table in tables)} GPU row(s)']
        sections.append({'step': f'benchmark {path.name}', 'ok': status == 0 and bool(tables),
                         'seconds': seconds, 'notes': notes, 'tables': tables, 'output': output})
    return sections


def gpu_tables(output):
    """Each Markdown table of the output that has rows naming a GPU: its header and those rows."""
    tables, table = [], []
    for line in output.splitlines() + ['']:
        if line.startswith('|'):
            table.append(line)
            continue
        rows = [row for row in table[2:] if re.search(r'gpu|cuda', row, re.I)]
        if rows:
            tables.append(table[:2] + rows)
        table = []
    return tables


def fenced(text):
    """Text in a Markdown code block whose fence no line of the text can close."""
    fence = '`' * max(3, 1 + max((len(m) for m in re.findall(r'`+', text)), default=0))
    return f'{fence}text\n{text.rstrip()}\n{fence}'


def requirements_table():
    lines = ['| module | install | needed for | here |', '|---|---|---|---|']
    for module, (package, why) in REQUIREMENTS.items():
        here = 'missing' if importlib.util.find_spec(module) is None else 'found'
        if module == 'cudnn' and carried_frontend():
            here = f'carried ({carried_frontend().name})'
        lines.append(f'| `{module}` | `{package}` | {why} | {here} |')
    return lines


def machine_lines(gpu, args):
    lines = [f'- when: {datetime.datetime.now().isoformat(timespec="seconds")}',
             f'- machine: {platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, '
             f'Python {platform.python_version()}',
             f'- command: `{" ".join([pathlib.Path(sys.executable).name] + sys.argv)}`',
             f'- workloads: {"quick (D2LPERF_QUICK=1)" if args.quick else "full"}']
    if gpu:
        lines.insert(2, f'- GPU: {gpu["name"]} ({gpu["count"]} visible), '
                        f'{gpu["memory_gib"]:.0f} GiB, compute capability '
                        f'{gpu["compute_capability"]}; CUDA runtime {gpu["cuda_runtime"]}, '
                        f'driver {gpu["cuda_driver"]}; CuPy {gpu["cupy"]}')
    return lines


def section_lines(section):
    mark = 'ok' if section['ok'] else 'FAILED'
    lines = ['', f'## {section["step"]}: {mark}', ''] + [f'- {n}' for n in section['notes']]
    for table in section.get('tables', []):
        lines += ['', 'GPU rows:', ''] + table
    if section.get('glued'):
        lines += ['', 'Values glued into the prose:', '', '| name | value |', '|---|---|']
        lines += [f'| {name} | {value:.4g} |' if isinstance(value, float) else
                  f'| {name} | {value} |' for name, value in section['glued'].items()]
    lines += ['', '<details><summary>output</summary>', '', fenced(section['output']), '',
              '</details>']
    return lines


def report_lines(gpu, reason, sections, args):
    if gpu is None:
        return ['# d2lperf GPU check: not run', '', f'No GPU was found: {reason}.',
                'Nothing was run.', ''] + machine_lines(gpu, args) + [
                '', 'On a machine with an NVIDIA GPU and CuPy, this check runs:', '',
                '1. cuDNN\'s convolutions against im2col: `python tests/cudnn_check.py`',
                f'2. the unit tests: `{" ".join(["python"] + unit_command()[1:])}`',
                '3. every chapter, cell by cell, on gpu(0): ' +
                ', '.join(p.name for p in chapter_paths()),
                '4. the GPU rows of the benchmarks: ' +
                ', '.join(' '.join([p.name] + GPU_ONLY_ARGUMENTS.get(p.name, []))
                          for p in gpu_benchmarks()), '',
                '## What it needs', ''] + requirements_table()
    failed = [s for s in sections if not s['ok']]
    lines = [f'# d2lperf GPU check: {"all passed" if not failed else f"{len(failed)} FAILED"}',
             ''] + machine_lines(gpu, args) + ['', '| step | result | seconds | notes |',
                                               '|---|---|--:|---|']
    lines += [f'| {s["step"]} | {"ok" if s["ok"] else "FAILED"} | {s["seconds"]:.0f} | '
              f'{"; ".join(s["notes"])} |' for s in sections]
    lines += ['', '## What it needs', ''] + requirements_table()
    for section in sections:
        lines += section_lines(section)
    return lines


def write_atomically(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + '.partial')
    partial.write_text(text)
    os.replace(partial, path)


def run_steps(args):
    sections = []
    for step, check in (('cudnn', check_cudnn), ('unit', check_unit),
                        ('chapters', check_chapters), ('benchmarks', check_benchmarks)):
        if step not in args.steps:
            continue
        missing = missing_modules(NEEDED[step])
        if missing:
            sections.append({'step': step, 'ok': False, 'seconds': 0, 'output': '',
                             'notes': [f'not run: install {", ".join(missing)} first']})
            continue
        found = check(args)
        sections += found if isinstance(found, list) else [found]
    return sections


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true',
                        help='the small workloads of D2LPERF_QUICK=1 (default: full sizes)')
    parser.add_argument('--report', type=pathlib.Path, default=ROOT / '_build' / 'gpu-check.md',
                        help='where to write the report (default: _build/gpu-check.md)')
    parser.add_argument('--steps', nargs='+', choices=STEPS, default=list(STEPS),
                        help='which steps to run (default: all four)')
    parser.add_argument('--jobs', type=int, default=1,
                        help='chapters run at a time (default 1: timings in their output '
                             'are then not disturbed by one another)')
    parser.add_argument('--timeout', type=int, default=3600,
                        help='seconds allowed to each test run, chapter and benchmark')
    parser.add_argument('--environment', action='store_true',
                        help='print the shell exports that put the carried cuDNN frontend and '
                             'its runtime on the paths (for benchmarks/gpu_session.sh), and stop')
    parser.add_argument('--fetch-wheels', action='store_true',
                        help='download the pinned cuDNN frontend\'s wheels into .gpu-wheels/ '
                             'for a machine with no package index, and stop')
    args = parser.parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels()
    if args.environment:
        print('\n'.join(f'export {name}={shlex.quote(value)}'
                        for name, value in frontend_paths().items()))
        return 0
    gpu, reason = probe_gpu()
    sections = run_steps(args) if gpu else []
    write_atomically(args.report, '\n'.join(report_lines(gpu, reason, sections, args)) + '\n')
    if gpu is None:
        print(f'[gpu-check] no GPU found ({reason}); nothing was run. '
              f'What would run is listed in {args.report}')
        return 0
    failed = [s['step'] for s in sections if not s['ok']]
    print(f'[gpu-check] {len(sections) - len(failed)} of {len(sections)} passed'
          + (f'; failed: {", ".join(failed)}' if failed else '') + f'. Report: {args.report}')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
