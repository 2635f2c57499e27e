"""Running small MPI programs from the distributed tests: each bounded by a timeout, past
which every process it started is ended; and checking that none is left behind."""
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip('mpi4py', reason='the distributed key-value store needs mpi4py '
                                     "(pip install -e '.[mpi]')")

ROOT = pathlib.Path(__file__).resolve().parents[1]
MPIEXEC = pathlib.Path(sys.executable).parent / 'mpiexec'


def environment(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), D2LPERF_QUICK='1', OMP_NUM_THREADS='1')
    env.update({name: str(value) for name, value in extra.items()})
    return env


class Ranks:
    """What each rank of a finished MPI program printed, read from its own files (lines of
    several processes sharing one pipe can be cut into each other)."""

    def __init__(self, folder, processes, returncode, messages):
        self.returncode, self.messages = returncode, messages
        read = lambda name: (folder / name).read_text() if (folder / name).exists() else ''
        self.stdout = {rank: read(f'stdout.{rank}') for rank in range(processes)}
        self.stderr = {rank: read(f'stderr.{rank}') for rank in range(processes)}

    def lines(self, prefix):
        """Every stdout line of every rank that starts with `prefix`, sorted."""
        return sorted(line for text in self.stdout.values() for line in text.splitlines()
                      if line.startswith(prefix))

    def report(self):
        return self.messages + ''.join(f'\n--- rank {rank} stderr:\n{text}'
                                       for rank, text in self.stderr.items())


def run_program(tmp_path, source, processes, timeout=120, **env):
    """Run `source` in `processes` MPI ranks on this host: a `Ranks`."""
    if not MPIEXEC.exists():
        pytest.skip(f'no mpiexec next to {sys.executable} (the mpich wheel brings one)')
    script = tmp_path / 'program.py'
    script.write_text(textwrap.dedent(source))
    try:
        finished = run_bounded([str(MPIEXEC), '-n', str(processes), '-outfile-pattern',
                                'stdout.%r', '-errfile-pattern', 'stderr.%r', sys.executable,
                                str(script)], timeout, env=environment(**env), cwd=tmp_path)
    except subprocess.TimeoutExpired as expired:        # say where each rank had got to
        printed = Ranks(tmp_path, processes, None,
                        (expired.stdout or '') + (expired.stderr or ''))
        pytest.fail(f'the {processes}-rank job did not end in {timeout} s; what each rank '
                    f'printed:\n{printed.report()}' + ''.join(
                        f'\n--- rank {rank} stdout:\n{text}'
                        for rank, text in printed.stdout.items()), pytrace=False)
    return Ranks(tmp_path, processes, finished.returncode, finished.stdout + finished.stderr)


def run_module(tmp_path, arguments, timeout=120, **env):
    """`python -m ARGUMENTS...` here; the finished process."""
    return run_bounded([sys.executable, '-m', *arguments], timeout, env=environment(**env),
                       cwd=tmp_path)


def run_bounded(command, timeout, **options):
    """`subprocess.run(command)`, captured, in a session of its own: past `timeout` seconds
    the whole session gets SIGTERM (the launcher then ends its job), then SIGKILL, so no rank
    is left behind; then subprocess.TimeoutExpired."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                               **options)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        expired.stdout, expired.stderr = end_session(process)     # what it printed, whole
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def end_session(process, grace=10):
    """SIGTERM to `process`'s session (its process group), SIGKILL after `grace` seconds;
    (stdout, stderr) as far as the process wrote them (None where it was not captured)."""
    for number, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        try:
            os.killpg(process.pid, number)
        except ProcessLookupError:
            break
        try:
            return process.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
    return None, None


def alive(pid):
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return ' Z ' not in pathlib.Path(f'/proc/{pid}/stat').read_text()
    except OSError:
        return False


def processes_running(marker):
    """PIDs of the processes whose command line mentions `marker` (not this one)."""
    found = []
    for entry in pathlib.Path('/proc').iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / 'cmdline').read_bytes().decode(errors='replace'):
                    found.append(int(entry.name))
            except OSError:
                pass
    return [pid for pid in found if alive(pid)]


def left_running(marker, seconds=15):
    """The processes that mention `marker` still running after up to `seconds`: killing is
    asynchronous, so this polls until none is left or the time is up."""
    deadline = time.monotonic() + seconds
    while processes_running(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return processes_running(marker)
