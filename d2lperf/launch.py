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
`--job-timeout SECONDS` ends the whole job once it has run that long (exit status 124).

Each rank runs inside a small guard (`--rank-guard`). It passes on every line the rank prints
whole, as `[rank] line`: mpiexec forwards whatever pieces it reads, and lines of several ranks
would otherwise run into each other. It names the rank when its command fails or is killed;
the launcher then shows that rank's last lines of stderr, ends the whole job within seconds
and exits non-zero. So does an ssh proxy that fails to start (the job could never begin),
naming its host. Ctrl-C, SIGTERM and a closed terminal (SIGHUP) end the job too, and mpiexec
gets a parent-death signal, so not even a SIGKILLed launcher leaves a process behind; a reader
that goes away (`... | head -1`) ends it as SIGPIPE ends a pipeline. Taught in "Parameter
Servers".
"""
import argparse
import collections
import ctypes
import fcntl
import os
import pathlib
import queue
import re
import select
import selectors
import shlex
import signal
import subprocess
import sys
import sysconfig
import threading
import time

FAILED = 'd2lperf.launch: rank'
GRACE_SECONDS = 10          # after a rank fails, how long mpiexec gets to end the rest
TAIL_LINES = 20
TIMED_OUT = 124             # the exit status of a job ended by --job-timeout, as timeout(1)'s
PR_SET_PDEATHSIG = 1
# A guard writes `[rank] line`, or a long line as pieces `[rank]+piece` ... `[rank] last piece`
FRAME = re.compile(rb'\[(\d+)\]([ +])(.*)')
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
    parser.add_argument('--job-timeout', type=float, metavar='SECONDS',
                        help='end the job once it has run this long, and exit 124 '
                             '(default: no limit)')
    parser.add_argument('command', nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.num_workers < 1 or args.num_servers < 1:
        parser.error('a job needs one worker (-n) and one server (-s) at least')
    if not args.command:
        parser.error('give the COMMAND each process runs, e.g. python train.py')
    for option, seconds in (('--timeout', args.timeout), ('--job-timeout', args.job_timeout)):
        if seconds is not None and not 0 < seconds < float('inf'):
            parser.error(f'{option} takes a positive number of seconds, not {seconds}')
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
    keeps freed memory is the engine's to set, when it starts: see `freed_memory`.)"""
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


def find_mpiexec():
    """The `mpiexec` the `mpich` wheel installed for this Python: next to it in a virtual
    environment, in its scripts folder where pip installs elsewhere (Colab's /usr/local/bin
    beside /usr/bin/python3)."""
    folders = dict.fromkeys([pathlib.Path(sys.executable).parent,
                             pathlib.Path(sysconfig.get_path('scripts'))])
    for folder in folders:
        if (folder / 'mpiexec').exists():
            return folder / 'mpiexec'
    raise SystemExit(f'd2lperf.launch: no mpiexec in {" or ".join(map(str, folders))}; install '
                     "MPICH with pip install -e '.[mpi]' (mpi4py and the mpich wheel)")


def mpiexec_command(args, environment):
    words = [str(find_mpiexec()), '-n', str(args.num_workers + args.num_servers)]
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
    """mpiexec and what it prints: each rank's lines echoed whole, the last lines each rank
    wrote to stderr kept for the report."""

    def __init__(self, words, hosts, environment, job_timeout=None):
        self.hosts, self.environment, self.job_timeout = hosts, environment, job_timeout
        self.deadline = time.monotonic() + job_timeout if job_timeout else None
        self.tails = collections.defaultdict(lambda: collections.deque(maxlen=TAIL_LINES))
        self.failures, self.proxies, self.launch_lines = [], [], []
        self.proxies_asked_for = queue.SimpleQueue()     # a reader asks, the main thread starts
        self.failed_at, self.timed_out, self.output_closed = None, False, False
        # SIGKILL, not SIGTERM: once mpiexec's connection closes, its proxies end their ranks
        # at once, and a killed mpiexec cannot get stuck on its way out.
        self.process = subprocess.Popen(words, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        env={**os.environ, **environment},
                                        preexec_fn=parent_death_signal(signal.SIGKILL))
        self.readers = [threading.Thread(target=self.read, args=(stream, fd), daemon=True)
                        for stream, fd in ((self.process.stdout, 1), (self.process.stderr, 2))]
        for reader in self.readers:
            reader.start()

    def read(self, stream, fd):
        """Echo one of mpiexec's streams to ours (`fd` 1 or 2), each rank's line whole."""
        for rank, line in joined_lines(stream):
            if rank is None:
                if self.hosts is None or not self.launched(line):
                    self.echo(fd, line)                  # mpiexec's own words
                continue
            self.echo(fd, b'[%d] %s\n' % (rank, line))
            if fd == 2:
                self.note_error_line(rank, line.decode(errors='replace'))

    def echo(self, fd, data):
        """Write to our stdout or stderr; once nobody reads it (`| head -1`), drop what follows
        but keep reading, so that no rank blocks on a full pipe while `wait` ends the job."""
        if not self.output_closed:
            try:
                write_all(fd, data)
            except OSError:                  # EPIPE, or EIO from a terminal that was closed
                self.output_closed = True

    def note_error_line(self, rank, line):
        """Keep a rank's stderr line for the report; the guard's last word marks a failure."""
        self.tails[rank].append(line)
        if line.startswith(FAILED):
            self.failures.append((rank, line))
            self.failed_at = self.failed_at or time.monotonic()

    def launched(self, line):
        """Whether `line` is one of `mpiexec -launcher manual`'s requests for a proxy a host;
        once all are in, `start_proxies` starts them."""
        line = line.decode(errors='replace')
        if line.startswith('HYDRA_LAUNCH:'):
            self.launch_lines.append(shlex.split(line.split(':', 1)[1]))
            return True
        if line.startswith('HYDRA_LAUNCH_END'):
            self.proxies_asked_for.put(list(zip(self.hosts, self.launch_lines)))
            return True
        return False

    def start_proxies(self):
        """Start the proxies mpiexec asked for, over ssh. From the main thread: a child's
        parent-death signal comes when the *thread* that started it ends."""
        while not self.proxies_asked_for.empty():
            for host, words in self.proxies_asked_for.get():
                self.proxies.append((host, subprocess.Popen(
                    ssh_command(host, words, self.environment), stdin=subprocess.DEVNULL,
                    start_new_session=True, preexec_fn=parent_death_signal(signal.SIGKILL))))

    def wait(self):
        """mpiexec's exit status, once it exits or `should_end` has it ended."""
        try:
            while self.process.poll() is None and not self.should_end():
                self.start_proxies()
                time.sleep(0.1)
        finally:
            self.end()
            for reader in self.readers:
                reader.join(timeout=5)
        return self.process.wait()          # at once: it exited, or `end` killed it

    def should_end(self):
        """Whether to end the job: GRACE_SECONDS after a rank failed (mpiexec mostly ends the
        rest before), at once when an ssh proxy failed (mpiexec would wait for it forever),
        past --job-timeout, or when nobody reads its output any more."""
        now = time.monotonic()
        if self.deadline is not None and now > self.deadline:
            self.timed_out = True
            self.failures.append((None, f'it ran longer than --job-timeout '
                                        f'{self.job_timeout:g} s, and was ended (give it more '
                                        'time, or find the rank that stalls: D2LPERF_VERBOSE=1 '
                                        'logs every push and pull)'))
            return True
        if self.failed_at is not None and now - self.failed_at > GRACE_SECONDS:
            return True
        return self.output_closed or (not self.failures and self.proxy_failed())

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
        """Signal every process group of the job: mpiexec's and each ssh proxy's. (mpiexec's
        proxies and ranks run in sessions of their own; mpiexec's end is theirs.)"""
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
        """What failed, and the failed rank's last lines of stderr; our exit status."""
        if self.output_closed:
            return 128 + signal.SIGPIPE      # as a pipeline's writer ends: quietly, no one reads
        if code == 0 and not self.failures:
            return 0
        rank, what = self.failures[0] if self.failures else (None, f'mpiexec exited {code}')
        print(f'\nd2lperf.launch: the job failed: {what}', file=sys.stderr)
        if rank is not None:
            print(f'd2lperf.launch: the last lines of rank {rank}, from its stderr:',
                  file=sys.stderr)
            for line in self.tails[rank]:
                print(f'    {line}', file=sys.stderr)
        if self.timed_out:
            return TIMED_OUT
        return code if code > 0 else 1


def joined_lines(frames):
    """(rank, line) for each line of a rank, its pieces joined again (see `RankLines`), and
    (None, raw line) for each of mpiexec's own."""
    pieces = {}
    for raw in frames:
        frame = FRAME.match(raw)
        if not frame:
            yield None, raw
        elif frame[2] == b'+':
            pieces[frame[1]] = pieces.get(frame[1], b'') + frame[3]
        else:
            yield int(frame[1]), pieces.pop(frame[1], b'') + frame[3]
    for rank, start in pieces.items():              # a rank killed in the middle of a line
        yield int(rank), start


def write_all(fd, data):
    """os.write until every byte is out (a write may take only some)."""
    while data:
        data = data[os.write(fd, data):]


class RankLines:
    """One of a rank's streams, passed on to our `fd` as whole lines, `[rank] line`.

    mpiexec forwards whatever its proxy reads from a rank's pipe, so lines are whole only if
    every read returns whole lines. Each write here is at most PIPE_BUF bytes, which a pipe
    never splits, and the proxy reads up to 64 KiB at a time, all that a pipe holds: so each
    write arrives in one piece. A longer line goes as several, `[rank]+piece` ... `[rank] last
    piece`, and the launcher joins them. (We measured it: five ranks writing 3,000 lines each,
    one write a line, of up to 20 KB gave 2,120 broken lines; of up to 4 KB, none.)
    """

    def __init__(self, fd, rank):
        self.fd, self.prefix, self.partial = fd, f'[{rank}]'.encode(), b''
        self.piece = select.PIPE_BUF - len(self.prefix) - 2      # room for the mark and '\n'
        try:                          # 64 KiB, even where a page is 64 KiB and a pipe 16 pages
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 16)
        except (AttributeError, OSError):
            pass                      # not Linux, or not a pipe: nothing reads it in pieces

    def feed(self, data):
        *lines, self.partial = (self.partial + data).split(b'\n')
        for line in lines:
            self.write(line)

    def finish(self):
        """The last line, which may have no newline."""
        if self.partial:
            self.write(self.partial)
            self.partial = b''

    def say(self, text):
        """A line of the guard's own."""
        self.write(text.encode(errors='replace'))

    def write(self, line):
        """One line, in pieces that each fit one write a pipe keeps whole."""
        starts = range(0, len(line), self.piece) or range(1)
        for start in starts[:-1]:
            write_all(self.fd, self.prefix + b'+' + line[start:start + self.piece] + b'\n')
        write_all(self.fd, self.prefix + b' ' + line[starts[-1]:] + b'\n')


def rank_guard(command):
    """Run one rank's command, passing its output on in whole lines; if it fails, say which
    rank, and exit non-zero."""
    parent_death_signal(signal.SIGTERM)()              # mpiexec's proxy gone: so are we
    rank = os.environ.get('PMI_RANK', '?')
    output, errors = RankLines(1, rank), RankLines(2, rank)
    try:
        child = subprocess.Popen(command, close_fds=False,     # MPI's PMI socket is inherited
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 preexec_fn=parent_death_signal(signal.SIGKILL))
    except OSError as error:
        errors.say(f'{FAILED} {rank} could not start {command[0]!r}: {error}')
        return 127
    for forwarded in (signal.SIGTERM, signal.SIGINT):
        signal.signal(forwarded, lambda number, _: child.send_signal(number))
    relay(child, {child.stdout.fileno(): output, child.stderr.fileno(): errors})
    code = child.wait()
    if code != 0:
        how = f'was killed by {signal.Signals(-code).name}' if code < 0 else f'exited {code}'
        shown = shlex.join(command).replace('\n', '\\n')[:200]     # one line, read as one
        errors.say(f'{FAILED} {rank} ({shown}) {how}')
    return code if code >= 0 else 128 - code


def relay(child, streams):
    """Pass the child's output on, {its pipe: RankLines}, until the pipes close, or until it
    has exited and a second went by with nothing to read (a process it left behind may hold
    them open)."""
    with selectors.DefaultSelector() as selector:
        for fd in streams:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            exited = child.poll() is not None        # if so, all it wrote is in the pipes
            ready = selector.select(timeout=1)
            if exited and not ready:
                break
            for key, _ in ready:
                data = os.read(key.fd, 1 << 16)
                if data:
                    streams[key.fd].feed(data)
                else:
                    selector.unregister(key.fd)
    for lines in streams.values():
        lines.finish()


def parent_death_signal(number):
    """A function that asks Linux (prctl PR_SET_PDEATHSIG) to send us `number` when the thread
    that started us ends: as a child's preexec_fn, the child dies with us, even when we are
    SIGKILLed. prctl is looked up here, before the fork: a child forked beside threads should
    do as little as it can. Elsewhere it does nothing; the process groups still end the job."""
    try:
        prctl = ctypes.CDLL(None).prctl
    except (AttributeError, OSError):
        return lambda: None
    return lambda: prctl(PR_SET_PDEATHSIG, int(number), 0, 0, 0)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ['--rank-guard']:
        return rank_guard(argv[1:])
    args = parse(argv)
    environment = job_environment(args)
    hosts = read_hosts(args.hostfile) if args.hostfile else None
    if args.sync_dst_dir:
        sync_to_hosts(hosts, args.sync_dst_dir)
    # kill, Ctrl-C and a closed terminal: we exit, and on the way `Job.wait` ends the job
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, lambda number, _: sys.exit(128 + number))
    words = mpiexec_command(args, environment)
    if os.environ.get('D2LPERF_VERBOSE'):
        print(f'd2lperf.launch: {shlex.join(words)}', file=sys.stderr, flush=True)
    job = Job(words, hosts if args.launcher == 'ssh' else None, environment, args.job_timeout)
    return job.report(job.wait())


if __name__ == '__main__':
    sys.exit(main())
