"""Timing and bookkeeping helpers every chapter, benchmark and module uses.

`Benchmark` and `Timer` measure wall-clock time; with an asynchronous engine, what they
measure is only meaningful once the work has been waited for (see "Asynchronous
Computation"). `median_seconds` is the one repeated-timing loop of the package, its
microbenchmarks and its benchmarks. `workload` is the one place that picks a chapter's size
from `D2LPERF_QUICK`. `atomic_write` is how the package writes a file. `Animator` plots
training curves as they grow.
"""
import contextlib
import io
import os
import statistics
import tempfile
import time

import numpy


def quick_mode():
    """True when `D2LPERF_QUICK=1`: tests and CI shrink every workload to fit 2 CPU cores."""
    return os.environ.get('D2LPERF_QUICK', '0') not in ('', '0', 'false', 'False')


def workload(full, quick):
    """The size a chapter runs: `full` as the text describes it, `quick` under `D2LPERF_QUICK=1`."""
    return quick if quick_mode() else full


class Timer:
    """Record several running times."""

    def __init__(self):
        self.times = []
        self.start()

    def start(self):
        self.tik = time.perf_counter()

    def stop(self):
        """Stop the timer, record the time since `start` and return it in seconds."""
        self.times.append(time.perf_counter() - self.tik)
        return self.times[-1]

    def avg(self):
        return sum(self.times) / len(self.times)

    def sum(self):
        return sum(self.times)

    def cumsum(self):
        return numpy.cumsum(self.times).tolist()


class Benchmark:
    """Context manager that prints how long its body took: `{description}: {secs:.4f} sec`."""

    def __init__(self, description='Done'):
        self.description = description
        self.seconds = None

    def __enter__(self):
        self.timer = Timer()
        return self

    def __exit__(self, *exc_info):
        self.seconds = self.timer.stop()
        print(f'{self.description}: {self.seconds:.4f} sec')


def time_calls(run, calls):
    """Seconds that `calls` back-to-back calls of `run()` take, on the host's clock."""
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return time.perf_counter() - start


def calls_lasting(run, min_seconds, time_calls):
    """After one warm-up call (page faults, lazy set-up, compilation): how many calls of
    `run()` take at least `min_seconds`, so the clock's resolution cannot show."""
    run()
    calls = 1
    while (elapsed := time_calls(run, calls)) < min_seconds:
        calls = max(2 * calls, int(calls * min_seconds / max(elapsed, 1e-9)))
    return calls


def median_seconds(run, repeats=5, min_seconds=2e-3, time_calls=time_calls):
    """Median seconds of one `run()`, over `repeats` timed batches after a warm-up call.

    `run` may be a dict of such functions: they are then timed round-robin, so that a drift
    of a busy machine hits all of them alike, and a dict of medians comes back.
    `time_calls(run, calls)` is the clock: the host's by default; CUDA events for GPU work.
    """
    runs = run if isinstance(run, dict) else {None: run}
    batch = {name: calls_lasting(fn, min_seconds, time_calls) for name, fn in runs.items()}
    samples = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            samples[name].append(time_calls(fn, batch[name]) / batch[name])
    medians = {name: statistics.median(times) for name, times in samples.items()}
    return medians if isinstance(run, dict) else medians[None]


def atomic_write(path, write):
    """Write a file through `write(binary_file)` so that readers see all of it or none.

    The data goes to a temporary file in the same folder, reaches the disk, and is renamed
    over `path`: a crash leaves the old file or the new one, never half of one."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f'.{os.path.basename(path)}.')
    try:
        with os.fdopen(handle, 'wb') as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise
    with contextlib.suppress(OSError, AttributeError):     # make the rename itself durable
        directory = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


class Accumulator:
    """Sum `n` running quantities (loss, correct predictions, examples seen)."""

    def __init__(self, n):
        self.data = [0.0] * n

    def add(self, *args):
        self.data = [a + float(b) for a, b in zip(self.data, args)]

    def reset(self):
        self.data = [0.0] * len(self.data)

    def __getitem__(self, idx):
        return self.data[idx]


def show_table(header, rows):
    """Display a table as HTML in a notebook. myst-nb renders a Markdown output as CommonMark,
    which has no tables: a Markdown table would reach the book as one paragraph of pipes."""
    import html
    from IPython.display import HTML, display
    cells = lambda tag, row: ''.join(f'<{tag}>{html.escape(str(c))}</{tag}>' for c in row)
    display(HTML('<table>\n<thead><tr>' + cells('th', header) + '</tr></thead>\n<tbody>\n'
                 + '\n'.join(f'<tr>{cells("td", row)}</tr>' for row in rows)
                 + '\n</tbody>\n</table>'))


def process_memory(device=None):
    """Bytes this process holds, as the operating system and CuPy see them: host memory (the
    resident set, freed blocks the C library keeps included) and, on a GPU, CuPy's pool in
    use. What the arrays hold, by kind, is `device.memory`."""
    import psutil
    used = {'host': psutil.Process().memory_info().rss, 'device': None}
    if device is not None and device.kind == 'gpu':
        used['device'] = device.xp.get_default_memory_pool().used_bytes()
    return used


class Animator:
    """A line plot that grows point by point while a model trains.

    In a notebook, `add` redraws the figure in place (one display, updated), so a live run
    shows the curves growing and the saved notebook (the built book) keeps exactly one
    figure, the last. Outside IPython it only draws, into `self.fig`.
    """

    def __init__(self, xlabel=None, ylabel=None, legend=None, xlim=None, ylim=None,
                 xscale='linear', yscale='linear', fmts=('-', 'm--', 'g-.', 'r:'),
                 nrows=1, ncols=1, figsize=(3.5, 2.5)):
        from matplotlib.figure import Figure      # not pyplot: no second copy at cell end
        self.fig = Figure(figsize=figsize, layout='tight')
        self.axes = list(self.fig.subplots(nrows, ncols, squeeze=False).ravel())
        self.axis_settings = dict(xlabel=xlabel, ylabel=ylabel, xlim=xlim, ylim=ylim,
                                  xscale=xscale, yscale=yscale)
        self.legend, self.fmts = legend or [], fmts
        self.X, self.Y = None, None                # one list of points per line
        self.display_handle = None

    def add(self, x, ys):
        """Append one point to each line: `x` shared or one per line, `ys` one per line."""
        ys = list(ys) if hasattr(ys, '__len__') else [ys]
        xs = list(x) if hasattr(x, '__len__') else [x] * len(ys)
        if self.Y is None:
            self.X, self.Y = [[] for _ in ys], [[] for _ in ys]
        if len(ys) != len(self.Y) or len(xs) != len(ys):
            raise ValueError(f'this plot has {len(self.Y)} lines; add() got {len(xs)} x and '
                             f'{len(ys)} y values')
        for line, (a, b) in enumerate(zip(xs, ys)):
            if a is not None and b is not None:
                self.X[line].append(a)
                self.Y[line].append(float(b))
        self.draw()
        self.show()

    def draw(self):
        axes = self.axes[0]
        axes.cla()
        for line, (x, y) in enumerate(zip(self.X, self.Y)):
            axes.plot(x, y, self.fmts[line % len(self.fmts)])
        axes.set(**self.axis_settings)
        if self.legend:
            axes.legend(self.legend)
        axes.grid(True)

    def show(self):
        """Display the figure the first time, then update that same display."""
        try:
            from IPython import get_ipython
            from IPython.display import SVG, display
        except ImportError:
            return
        if get_ipython() is None:
            return
        image = SVG(self.svg())
        if self.display_handle is None:
            self.display_handle = display(image, display_id=True)
        else:
            self.display_handle.update(image)

    def svg(self):
        """The figure as SVG text: sharp at any zoom in the built book."""
        buffer = io.BytesIO()
        self.fig.savefig(buffer, format='svg', metadata={'Date': None})
        return buffer.getvalue().decode()
