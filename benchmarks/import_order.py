"""Does it matter whether a script imports NumPy or d2lperf first? LeNet's rows, both ways.

OpenBLAS's idle threads spin for a tenth of a second after each product unless told
otherwise, holding the cores that the engine's pieces and lanes need. d2lperf gives them a
brief spin as it is imported (engine/blas.py, `spin_briefly`): before NumPy loads, by the
variable OpenBLAS reads; after, by restarting OpenBLAS's threads where that is safe. This runs
`training.py`'s LeNet rows in fresh child processes, d2lperf first and NumPy first,
alternating, and prints each row's best img/s both ways and their ratio (RESULTS.md has the
figures before and after the restart).

    python benchmarks/import_order.py [--rounds 3]

Benchmark with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset, as a reader's machine has them
(`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python ...`); both are printed.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent

CHILD = """
import sys
{first}
sys.path.insert(0, {here!r})
import json
import training
rows = training.lenet_rows(training.available_cores())
print(json.dumps([[name, threads, ips] for name, threads, ips in rows]))
"""

FIRSTS = {'d2lperf first': 'import d2lperf', 'NumPy first': 'import numpy'}


def run_child(first):
    code = CHILD.format(first=FIRSTS[first], here=str(HERE))
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=1800, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=3)
    rounds = parser.parse_args().rounds
    print('# OPENBLAS_CORETYPE=%s OPENBLAS_L2_SIZE=%s OPENBLAS_THREAD_TIMEOUT=%s' % tuple(
        os.environ.get(name, '(unset)') for name in
        ('OPENBLAS_CORETYPE', 'OPENBLAS_L2_SIZE', 'OPENBLAS_THREAD_TIMEOUT')))
    runs = {first: [] for first in FIRSTS}
    for round_ in range(rounds):
        for first in (FIRSTS if round_ % 2 == 0 else reversed(list(FIRSTS))):
            runs[first].append({(name, threads): ips for name, threads, ips in run_child(first)})
    # This VM's speed drifts from one process to the next by more than the effect, so each
    # row is read against the floor (NumPy by hand) or PyTorch measured in the same process.
    print(f'LeNet, batch 256: img/s over the same process\'s reference, median of {rounds} '
          'alternated child processes each way')
    print('| what | threads | over | d2lperf first | NumPy first |\n|---|--:|---|--:|--:|')
    for name, threads in runs['d2lperf first'][0]:
        for reference in ('NumPy im2col by hand (floor)', 'PyTorch eager'):
            if name == reference or (reference, threads) not in runs['d2lperf first'][0]:
                continue
            medians = [statistics.median(run[name, threads] / run[reference, threads]
                                         for run in runs[first]) for first in FIRSTS]
            print(f'| {name} | {threads} | {reference} | {medians[0]:.2f} | {medians[1]:.2f} |')


if __name__ == '__main__':
    main()
