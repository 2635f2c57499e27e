"""Running small MPI programs from the distributed tests: each bounded by a timeout."""
import os
import pathlib
import subprocess
import sys
import textwrap

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
    finished = subprocess.run([str(MPIEXEC), '-n', str(processes), '-outfile-pattern',
                               'stdout.%r', '-errfile-pattern', 'stderr.%r', sys.executable,
                               str(script)], capture_output=True, text=True, timeout=timeout,
                              env=environment(**env), cwd=tmp_path)
    return Ranks(tmp_path, processes, finished.returncode, finished.stdout + finished.stderr)


def run_module(tmp_path, arguments, timeout=120, **env):
    """`python -m ARGUMENTS...` here; the finished process."""
    return subprocess.run([sys.executable, '-m', *arguments], capture_output=True, text=True,
                          timeout=timeout, env=environment(**env), cwd=tmp_path)
