"""The distributed key-value store against plain MPI, and LeNet on 1, 2 and 4 worker processes.

    python benchmarks/distributed.py            # full sizes
    python benchmarks/distributed.py lenet      # only the LeNet jobs
    D2LPERF_QUICK=1 python benchmarks/distributed.py

Rows, measured side by side in one MPI job of 2 workers and 1 server (started with
`python -m d2lperf.launch`, whose environment is the one a training job gets; every rank
keeps freed memory, `freed_memory`, from the start, as a rank's engine would ask):
* plain MPI: both workers `Send` a 64 MiB buffer to the server and `Recv` it back, the
  traffic of one synchronous push and pull; then `Allreduce` of the same buffer among the
  workers (MPICH's own algorithm, no server);
* the `dist_sync` store: `push` then `pull` of a 64 MiB key, the round the servers sum.
Then steps per second of LeNet training (`python -m d2lperf.train_mnist`) with 1, 2 and 4
worker processes and one server, each worker with a batch of its own, and the images a second
of all workers over one worker's. Each timing is the best of several rounds in several jobs,
since where the OS places a job's processes moves its times by a third.
"""
import os
import re
import subprocess
import sys
import time

import numpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2 ** 20


def quick():
    return os.environ.get('D2LPERF_QUICK') == '1'


def best(run, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def in_job(size_bytes, repeats):
    """The part that runs inside the MPI job, on every rank."""
    from mpi4py import MPI

    import d2lperf as d2l
    d2l.engine.freed_memory.keep_freed_memory()     # the policy the store's engine sets: plain MPI too
    world = MPI.COMM_WORLD
    server = world.size - 1
    is_server = world.rank == server
    worker_comm = world.Split(1 if is_server else 0, world.rank)
    buffer = numpy.ones(size_bytes // 4, numpy.float32)
    back = numpy.empty_like(buffer)

    def plain_round():
        if is_server:
            for worker in range(server):
                world.Recv(back, source=worker, tag=1)
            for worker in range(server):
                world.Send(back, dest=worker, tag=2)
        else:
            world.Send(buffer, dest=server, tag=1)
            world.Recv(back, source=server, tag=2)
    world.Barrier()
    plain = best(lambda: (plain_round(), world.Barrier()), repeats)
    allreduce = None
    if not is_server:
        worker_comm.Barrier()
        allreduce = best(lambda: worker_comm.Allreduce(MPI.IN_PLACE, buffer), repeats)
    store = d2l.kvstore.create('dist_sync')                 # a server serves here, then exits
    value = d2l.np.ones(buffer.shape)            # the Allreduce above changed `buffer`
    out = d2l.np.zeros(value.shape)
    store.init('x', value)

    def store_round():
        store.push('x', value)
        store.pull('x', out=out)
        out.wait_to_read()
    store_round()
    store.barrier()
    pushpull = best(lambda: (store_round(), store.barrier()), repeats)
    if store.rank == 0:
        expected = float(store.num_workers)      # each round stores the sum of the pushes
        wrong = int((out.asnumpy() != expected).sum())
        print(f'RESULT plain={plain} allreduce={allreduce} pushpull={pushpull} wrong={wrong}',
              flush=True)


def run_job(size_bytes, repeats):
    command = [sys.executable, '-m', 'd2lperf.launch', '-n', '2', '-s', '1',
               sys.executable, os.path.abspath(__file__), '--in-job', str(size_bytes),
               str(repeats)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    found = re.search(r'RESULT plain=(\S+) allreduce=(\S+) pushpull=(\S+) wrong=(\d+)',
                      done.stdout + done.stderr)
    if done.returncode or not found:
        raise RuntimeError(f'the benchmark job failed:\n{done.stdout}\n{done.stderr}')
    plain, allreduce, pushpull = (float(found.group(i)) for i in (1, 2, 3))
    return plain, allreduce, pushpull, int(found.group(4))


def lenet_steps_per_second(workers, examples, batch):
    """Steps a second of one worker of a dist_sync LeNet job, from train_mnist's last epoch."""
    command = [sys.executable, '-m', 'd2lperf.launch', '-n', str(workers), '-s', '1',
               sys.executable, '-m', 'd2lperf.train_mnist', '--network', 'lenet',
               '--kv-store', 'dist_sync', '--batch-size', str(batch), '--epochs', '2',
               '--max-examples', str(examples), '--devices', 'cpu0']
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    speeds = re.findall(r'([0-9.]+) images/s', done.stdout)
    if done.returncode or not speeds:
        raise RuntimeError(f'the training job failed:\n{done.stdout}\n{done.stderr}')
    return float(speeds[-1]) / batch


def main(sections=('store', 'lenet')):
    jobs = 1 if quick() else 3
    if 'store' in sections:
        store_section(jobs)
    if 'lenet' in sections:
        lenet_section(jobs)


def store_section(jobs):
    size = (4 if quick() else 64) * MIB
    repeats = 3 if quick() else 15
    runs = [run_job(size, repeats) for _ in range(jobs)]     # a job's start decides much
    plain, allreduce, pushpull = (min(run[i] for run in runs) for i in range(3))
    wrong = max(run[3] for run in runs)
    print(f'# {size // MIB} MiB of float32, 2 workers and 1 server on this machine, '
          f'best of {repeats} rounds in each of {jobs} jobs\n')
    print('| what | ms | GB/s per worker | × plain MPI |\n|---|--:|--:|--:|')
    for name, seconds in (('plain MPI Send + Recv through the server', plain),
                          ('MPI Allreduce among the workers', allreduce),
                          (f'dist_sync push + pull (#wrong = {wrong})', pushpull)):
        print(f'| {name} | {seconds * 1e3:.1f} | {2 * size / seconds / 1e9:.2f} | '
              f'{seconds / plain:.2f} |')


def lenet_section(jobs):
    load = os.getloadavg()[0]
    examples, batch = (512, 64) if quick() else (8192, 128)
    counts = (1, 2) if quick() else (1, 2, 4)
    speeds = lenet_images_per_second(counts, examples, batch, jobs)
    print(f'\n# LeNet, dist_sync, 1 server, {os.cpu_count()} cores, load average before '
          f'{load:.2f}; best of {jobs} jobs each, run round robin')
    print('| workers | steps/s a worker | images/s in all | × one worker |\n|--:|--:|--:|--:|')
    for workers, images in speeds.items():
        print(f'| {workers} | {images / batch / workers:.1f} | {images:.0f} | '
              f'{images / speeds[1]:.2f} |')


def lenet_images_per_second(counts, examples, batch, jobs):
    """Images a second in all of a LeNet job with each count of workers: the best of `jobs`
    jobs, the counts taken in turn, so that a busy spell of the machine hits them alike."""
    best = dict.fromkeys(counts, 0.0)
    for _ in range(jobs):
        for workers in counts:
            images = lenet_steps_per_second(workers, examples, batch) * batch * workers
            best[workers] = max(best[workers], images)
    return best


if __name__ == '__main__':
    if sys.argv[1:2] == ['--in-job']:
        in_job(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main(sys.argv[1:] or ('store', 'lenet'))     # python benchmarks/distributed.py lenet
