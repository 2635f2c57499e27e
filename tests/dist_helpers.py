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


def run_program(tmp_path, source, processes, timeout=120, **env):
    """Run `source` in `processes` MPI ranks on this host; the finished process."""
    if not MPIEXEC.exists():
        pytest.skip(f'no mpiexec next to {sys.executable} (the mpich wheel brings one)')
    script = tmp_path / 'program.py'
    script.write_text(textwrap.dedent(source))
    return subprocess.run([str(MPIEXEC), '-n', str(processes), sys.executable, str(script)],
                          capture_output=True, text=True, timeout=timeout,
                          env=environment(**env), cwd=tmp_path)


def run_module(tmp_path, arguments, timeout=120, **env):
    """`python -m ARGUMENTS...` here; the finished process."""
    return subprocess.run([sys.executable, '-m', *arguments], capture_output=True, text=True,
                          timeout=timeout, env=environment(**env), cwd=tmp_path)
