"""Start a distributed job: `python -m d2lperf.launch -n WORKERS [-s SERVERS] COMMAND ...`.

Every process of the job runs COMMAND under MPICH's `mpiexec` (the one next to this Python,
which the `mpich` wheel installs); `kvstore.dist` gives the last SERVERS ranks the server role.
`--launcher local` runs them all on this host, `mpi` on the hosts of a hostfile (`-H`, MPICH's
`-f`), and `ssh` starts MPICH's per-host proxy on each host with our own `ssh HOST COMMAND`
(`mpiexec -launcher manual` prints what to run; we quote each word, nothing is pasted into a
shell unquoted). `--sync-dst-dir DIR` first copies this folder to DIR on every host with rsync,
and the job runs there. D2LPERF_INTERFACE=eth0 picks the network interface (`-iface`);
D2LPERF_VERBOSE=1 prints the mpiexec command before running it.
`--timeout SECONDS` sets D2LPERF_TIMEOUT for every rank: how long any wait of the distributed
store may block before it raises, naming the rank it waited for, the key and the command.

Each rank runs inside a small guard (`--rank-guard`) that names the rank when its command
fails or is killed; the launcher then shows that rank's last lines, ends the whole job within
seconds (process groups, and parent-death signals so no child outlives its guard) and exits
non-zero. So does an ssh proxy that fails to start (the job could never begin), naming its
host. Taught in "Parameter Servers".
"""
import argparse
import collections
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

FAILED = 'd2lperf.launch: rank'
GRACE_SECONDS = 10          # after a rank fails, how long mpiexec gets to end the rest
TAIL_LINES = 20
NAME = re.compile(r'[A-Za-z_][A-Za-z0-9_]*\Z')
HOST = re.compile(r'[A-Za-z0-9][A-Za-z0-9._-]*\Z')     # never an option: no leading '-'


def parse(argv):
    parser = argparse.ArgumentParser(prog='python -m d2lperf.launch',
                                     description='Start a d2lperf distributed job.')
    parser.add_argument('-n', '--num-workers', type=int, required=True)
    parser.add_argument('-s', '--num-servers', type=int, default=1)
    parser.add_argument('--launcher', choices=('local', 'mpi', 'ssh'), default='local')
    parser.add_argument('-H', '--hostfile')
    parser.add_argument('--sync-dst-dir')
    parser.add_argument('--env', action='append', default=[], metavar='NAME=VALUE')
    parser.add_argument('--timeout', type=float, metavar='SECONDS',
                        help='D2LPERF_TIMEOUT of every rank: how long a distributed wait may '
                             'block before it raises (default: this environment\'s, else 300)')
    parser.add_argument('command', nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.num_workers < 1 or args.num_servers < 1:
        parser.error('a job needs one worker (-n) and one server (-s) at least')
    if not args.command:
        parser.error('give the COMMAND each process runs, e.g. python train.py')
    if args.timeout is not None and not 0 < args.timeout < float('inf'):
        parser.error(f'--timeout takes a positive number of seconds, not {args.timeout}')
    if args.launcher != 'local' and not args.hostfile:
        parser.error(f'--launcher {args.launcher} needs a hostfile: -H HOSTFILE')
    if args.launcher == 'local' and (args.hostfile or args.sync_dst_dir):
        parser.error('-H and --sync-dst-dir need --launcher mpi or ssh')
    for item in args.env:
        name, equals, _ = item.partition('=')
        if not equals or not NAME.match(name):
            parser.error(f'--env takes NAME=VALUE with NAME a variable name, not {item!r}')
    return args


def job_environment(args):
    """{name: value} every rank gets: the server count, the timeout (`--timeout`, or this
    process's D2LPERF_TIMEOUT, which ssh would not carry) and the user's. (How a rank's malloc
    keeps freed memory is the engine's to set, when it starts: see `host_memory`.)"""
    environment = {'D2LPERF_NUM_SERVERS': str(args.num_servers)}
    if os.environ.get('D2LPERF_TIMEOUT'):
        environment['D2LPERF_TIMEOUT'] = os.environ['D2LPERF_TIMEOUT']
    environment.update(item.split('=', 1) for item in args.env)
    if args.timeout is not None:
        environment['D2LPERF_TIMEOUT'] = f'{args.timeout:g}'
    return environment


def read_hosts(hostfile):
    """The hosts of an MPICH hostfile (`host` or `host:slots` a line), in its order, which
    is the order of mpiexec's proxies. Each is checked before it reaches an ssh or rsync
    command line, where a word starting with '-' would be read as an option."""
    hosts = []
    lines = pathlib.Path(hostfile).read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if line and not line.startswith('#'):
            hosts.append(checked_host(line, f'{hostfile} line {number}'))
    if not hosts:
        raise SystemExit(f'd2lperf.launch: hostfile {hostfile} names no host')
    return hosts


def checked_host(line, where):
    """The host of a hostfile line `host` or `host:slots`, or SystemExit naming the line."""
    host, colon, slots = line.partition(':')
    if not HOST.match(host) or (colon and not slots.isdigit()):
        raise SystemExit(f'd2lperf.launch: {where}: {line!r} is not `host` or `host:slots`; a '
                         "host name has letters, digits, '.', '-' and '_' and starts with a "
                         'letter or digit, slots is a number')
    return host


def mpiexec_command(args, environment):
    mpiexec = pathlib.Path(sys.executable).parent / 'mpiexec'
    if not mpiexec.exists():
        raise SystemExit(f'd2lperf.launch: no mpiexec next to {sys.executable}; install '
                         "MPICH with pip install -e '.[mpi]' (mpi4py and the mpich wheel)")
    words = [str(mpiexec), '-n', str(args.num_workers + args.num_servers), '-prepend-rank']
    if os.environ.get('D2LPERF_INTERFACE'):
        words += ['-iface', os.environ['D2LPERF_INTERFACE']]
    if args.launcher != 'local':
        words += ['-f', args.hostfile]
    if args.launcher == 'ssh':
        words += ['-launcher', 'manual']
    if args.sync_dst_dir:
        words += ['-wdir', args.sync_dst_dir]
    for name, value in environment.items():
        words += ['-genv', name, value]
    return words + [sys.executable, '-m', 'd2lperf.launch', '--rank-guard', *args.command]


def sync_to_hosts(hosts, destination):
    """Copy this folder to `destination` on every host (rsync over ssh)."""
    for host in dict.fromkeys(hosts):
        command = ['rsync', '-a', '--protect-args', '--exclude', '.git', f'{os.getcwd()}/',
                   f'{host}:{destination}/']     # the remote path is not split by its shell
        if subprocess.run(command).returncode != 0:
            raise SystemExit(f'd2lperf.launch: copying {os.getcwd()} to {host}:{destination} '
                             f'failed ({shlex.join(command)})')


def ssh_command(host, proxy_words, environment):
    """`ssh HOST 'env NAME=VALUE ... PROXY ...'`, every word quoted for the remote shell."""
    remote = ['env', *(f'{name}={value}' for name, value in environment.items()), *proxy_words]
    return ['ssh', host, shlex.join(remote)]


class Job:
    """mpiexec and what it prints: echoed, the last lines of each rank kept."""

    def __init__(self, words, hosts, environment):
        self.hosts, self.environment = hosts, environment
        self.tails = collections.defaultdict(lambda: collections.deque(maxlen=TAIL_LINES))
        self.failures, self.proxies, self.launch_lines = [], [], []
        self.failed_at = None
        self.process = subprocess.Popen(words, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                        start_new_session=True,
                                        env={**os.environ, **environment})
        self.readers = [threading.Thread(target=self.read, args=(stream, echo), daemon=True)
                        for stream, echo in ((self.process.stdout, sys.stdout),
                                             (self.process.stderr, sys.stderr))]
        for reader in self.readers:
            reader.start()

    def read(self, stream, echo):
        for line in stream:
            if self.hosts is not None and self.launched(line):
                continue
            line = without_repeated_prefix(line.rstrip('\n'))
            echo.write(line + '\n')
            echo.flush()
            found = re.match(r'\[(\d+)\] (.*)', line)
            if found:
                self.tails[int(found[1])].append(found[2])
            failed = re.search(FAILED + r' (\d+) .*', line)   # its own rank: lines get cut
            if failed:
                self.failures.append((int(failed[1]), failed[0]))
                self.failed_at = self.failed_at or time.monotonic()

    def launched(self, line):
        """Start the proxies that `mpiexec -launcher manual` asks for, one a host, over ssh."""
        if line.startswith('HYDRA_LAUNCH:'):
            self.launch_lines.append(shlex.split(line.split(':', 1)[1]))
            return True
        if line.startswith('HYDRA_LAUNCH_END'):
            for host, words in zip(self.hosts, self.launch_lines):
                self.proxies.append((host, subprocess.Popen(
                    ssh_command(host, words, self.environment), stdin=subprocess.DEVNULL,
                    start_new_session=True)))
            return True
        return False

    def wait(self):
        """mpiexec's exit code; a job a rank failed in ends within GRACE_SECONDS, one whose ssh
        proxy failed at once (mpiexec would wait for that proxy forever)."""
        try:
            while self.process.poll() is None:
                if self.failed_at and time.monotonic() - self.failed_at > GRACE_SECONDS:
                    self.end()
                if not self.failures and self.proxy_failed():
                    self.end()
                time.sleep(0.1)
        finally:
            self.end()
            for reader in self.readers:
                reader.join(timeout=5)
        return self.process.returncode

    def proxy_failed(self):
        """Whether an ssh proxy exited non-zero (noted as the job's failure, naming its host)."""
        for host, proxy in self.proxies:
            if proxy.poll():
                self.failures.append((None, f'the MPI proxy for host {host} exited '
                                            f'{proxy.returncode} ({shlex.join(proxy.args)[:200]})'
                                            f'; check that `ssh {host}` works'))
                return True
        return False

    def end(self):
        """Signal every process group of the job: mpiexec's and each ssh proxy's."""
        for pid in [self.process.pid] + [proxy.pid for _, proxy in self.proxies]:
            for signal_number in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(pid, signal_number)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
        self.process.poll()
        for _, proxy in self.proxies:
            proxy.poll()

    def report(self, code):
        """What failed, and the failed rank's last lines, on stderr."""
        if code == 0 and not self.failures:
            return 0
        rank, what = self.failures[0] if self.failures else (None, f'mpiexec exited {code}')
        print(f'\nd2lperf.launch: the job failed: {what}', file=sys.stderr)
        if rank is not None:
            print(f'd2lperf.launch: the last lines of rank {rank}:', file=sys.stderr)
            for line in self.tails[rank]:
                print(f'    {line}', file=sys.stderr)
        return code or 1


def without_repeated_prefix(line):
    """`[1] text` of a line that mpiexec's -prepend-rank cut as `[1] te[1] xt`: it prefixes
    every piece it reads, not every line."""
    found = re.match(r'(\[\d+\] )(.*)', line)
    if not found:
        return line
    prefix, rest = found.groups()
    return prefix + rest.replace(prefix, '')


def rank_guard(command):
    """Run one rank's command; if it fails, say which rank, and exit non-zero."""
    set_parent_death_signal(signal.SIGTERM)            # mpiexec's proxy gone: so are we
    rank = os.environ.get('PMI_RANK', '?')
    try:
        child = subprocess.Popen(command, close_fds=False,     # MPI's PMI socket is inherited
                                 preexec_fn=lambda: set_parent_death_signal(signal.SIGKILL))
    except OSError as error:
        print(f'{FAILED} {rank} could not start {command[0]!r}: {error}', file=sys.stderr)
        return 127
    for forwarded in (signal.SIGTERM, signal.SIGINT):
        signal.signal(forwarded, lambda number, _: child.send_signal(number))
    code = child.wait()
    if code != 0:
        how = f'was killed by {signal.Signals(-code).name}' if code < 0 else f'exited {code}'
        sys.stderr.write(f'{FAILED} {rank} ({shlex.join(command)[:200]}) {how}\n')
        sys.stderr.flush()
    return code if code >= 0 else 128 - code


def set_parent_death_signal(number):
    """Linux's prctl(PR_SET_PDEATHSIG): get `number` when the parent process dies."""
    import ctypes
    try:
        ctypes.CDLL(None).prctl(1, int(number), 0, 0, 0)
    except (AttributeError, OSError):
        pass                       # not Linux: the process groups still end the job


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ['--rank-guard']:
        return rank_guard(argv[1:])
    args = parse(argv)
    environment = job_environment(args)
    hosts = read_hosts(args.hostfile) if args.hostfile else None
    if args.sync_dst_dir:
        sync_to_hosts(hosts, args.sync_dst_dir)
    signal.signal(signal.SIGTERM, lambda number, _: sys.exit(128 + number))  # ends the job too
    words = mpiexec_command(args, environment)
    if os.environ.get('D2LPERF_VERBOSE'):
        print(f'd2lperf.launch: {shlex.join(words)}', file=sys.stderr, flush=True)
    job = Job(words, hosts if args.launcher == 'ssh' else None, environment)
    return job.report(job.wait())


if __name__ == '__main__':
    sys.exit(main())
