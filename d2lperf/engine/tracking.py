"""Dependency tracking: the bookkeeping that decides when an operation may run.

As in MXNet's engine, the engine knows only *variables* (tags for pieces of data) and
*operations* (functions with the variables they read and write). Each variable keeps a queue
of the operations waiting for it; an operation runs once every variable has granted it
access: readers after the last writer, a writer after every earlier reader and writer (RAW,
WAR, WAW). Nothing here starts a thread: `engines.py` holds the policies that run what these
rules let through. `execute` is the one way every engine runs an operation: it keeps a failure
on what the operation writes and fills in the operation's record for the profiler.
Taught in "Asynchronous Computation".
"""
import collections
import itertools
import time
import weakref

from .lanes import COMPUTE

_var_ids = itertools.count()


class OperationError(RuntimeError):
    """An operation raised; it surfaces at the first wait on what the operation writes.

    `reported` once a wait has raised it: `wait_all` raises only failures nobody was shown
    (a failed `asnumpy()` is not raised again by the next unrelated `wait_all`)."""

    def __init__(self, name, cause):
        super().__init__(f"operation '{name}' failed: {type(cause).__name__}: {cause}")
        self.op_name = name
        self.reported = False


class Var:
    """A tag for one piece of data, with the queue of operations waiting to use it."""

    __slots__ = ('id', 'pending', 'num_reading', 'writing', 'writer', 'error', '__weakref__')

    def __init__(self):
        self.id = next(_var_ids)
        self.pending = None                  # (operation, is_write) not yet granted: a deque
                                             # made by the first that waits (most never do)
        self.num_reading = 0                 # granted reads still running
        self.writing = False                 # a granted write still running
        self.writer = None                   # the last pushed write, until it completes
        self.error = None                    # the OperationError that failed it, until an
                                             # operation overwrites it whole (`overwrites`)

    def __repr__(self):
        return f'Var({self.id})'


class Operation:
    """A function with the variables it reads and writes; `waiting` counts missing grants.

    A variable may be read twice (x * x) but never both read and written by one operation:
    an in-place update lists its target among the writes only. An operation that `overwrites`
    its writes whole (`x[:] = y`) builds on none of their values, so it does not inherit their
    failure, and clears it. A `skippable` operation (an optimizer's update) whose input
    failed is skipped instead (`execute`). While the engine records (`recording` is a list),
    the operation's `OpRecord` goes into it.
    """

    __slots__ = ('fn', 'name', 'device', 'lane', 'reads', 'writes', 'waiting', 'record',
                 'overwrites', 'skippable')

    def __init__(self, fn, reads, writes, device, name, lane=COMPUTE, recording=None,
                 overwrites=False, skippable=False):
        self.fn, self.name, self.device, self.lane = fn, name, device, lane
        self.reads, self.writes, self.overwrites = reads, writes, overwrites
        self.skippable = skippable
        self.waiting = len(reads) + len(writes)          # grants still missing
        self.record = None
        if recording is not None and device is not None:
            self.record = OpRecord(self)
            recording.append(self.record)


# -- dependency tracking: pure bookkeeping on one variable, called under the engine lock --

def append_read(var, op):
    """Grant `op` a read of `var` now, counted off `op.waiting` with it (nothing can come in
    between, not even Ctrl-C: see `take_back`), or queue it behind a writer."""
    if not var.writing and not var.pending:
        var.num_reading += 1
        op.waiting -= 1
    else:
        wait_in_line(var, op, False)


def append_write(var, op):
    """Grant `op` a write of `var` now, counted off `op.waiting`, or queue it behind earlier
    readers and writers."""
    if not var.writing and not var.num_reading and not var.pending:
        var.writing = True
        op.waiting -= 1
    else:
        wait_in_line(var, op, True)


def free_to_run(reads, writes):
    """Whether an operation reading `reads` and writing `writes` would be granted every one
    now, with nothing queued on them (`append_read`'s and `append_write`'s tests, inlined:
    a short push asks it for every variable of every call)."""
    for var in reads:
        if var.writing or var.pending:
            return False
    for var in writes:
        if var.writing or var.num_reading or var.pending:
            return False
    return True


def wait_in_line(var, op, is_write):
    """Queue `op` on `var`, making the queue first: most variables never need one."""
    pending = var.pending
    if pending is None:
        pending = var.pending = collections.deque()
    pending.append((op, is_write))


def take_back(op, tracked):
    """Undo what a push cut short (by Ctrl-C) did for `op` on its first `tracked` variables
    (reads, then writes) and on the next, half done: under the engine lock, as the push was.

    Each variable queued `op` or granted it. Queued entries are at the end of the variable's
    queue (nobody else could push meanwhile): they are removed. The grants are those counted
    off `op.waiting`, each with its own (`append_read`), in the order the variables were
    tried: they are given back. One variable read twice (x * x) goes alike both times, as the
    first grant leaves it as free as it was, and a first place in its queue keeps the second
    in the queue too. Its record, if any, never gets a start: the profiler skips it."""
    tried = [*op.reads, *op.writes][:tracked + 1]
    queued = set()
    for var in tried:
        pending = var.pending
        while pending and pending[-1][0] is op:
            pending.pop()
            queued.add(var)
    grants = len(op.reads) + len(op.writes) - op.waiting
    for i, var in enumerate(tried):
        if grants and var not in queued:
            grants -= 1
            if i < len(op.reads):
                var.num_reading -= 1
            else:
                var.writing = False


def complete_read(var, granted):
    var.num_reading -= 1
    if not var.num_reading and var.pending:     # the head must be a writer
        var.writing = True
        granted.append(var.pending.popleft()[0])


def complete_write(var, granted):
    """The write is done: let the following readers in together, or else the next writer."""
    var.writing = False
    pending = var.pending
    while pending and not pending[0][1]:
        granted.append(pending.popleft()[0])
        var.num_reading += 1
    if not var.num_reading and pending:
        var.writing = True
        granted.append(pending.popleft()[0])


class OpRecord:
    """What a trace keeps of one operation, for dependency graphs and the profiler: `worker`
    names the lane (thread or GPU stream) that ran it, and `helped` the thread that ran it in the
    lane's place while waiting for it (None: the lane's own thread); `start` and `end` are
    `time.perf_counter()` seconds; on a GPU, `events` are the CUDA events around its kernels
    (for device times)."""

    __slots__ = ('name', 'device', 'lane', 'reads', 'writes', 'worker', 'helped', 'start', 'end',
                 'events')

    def __init__(self, op):
        self.name, self.device, self.lane = op.name, op.device, op.lane
        self.reads = [v.id for v in op.reads]
        self.writes = [v.id for v in op.writes]
        self.worker, self.helped, self.start, self.end, self.events = (None,) * 5

    def __repr__(self):
        return f'OpRecord({self.name!r}, reads={self.reads}, writes={self.writes})'


def inherited_error(op):
    """The failure `op` inherits: from what it reads, or from what it updates, since a write
    into a failed array (`x += 1`, `x[0] = 5`, a view of it) builds on values nobody has; an
    operation that overwrites its writes whole (`x[:] = 0`) builds on none."""
    for var in op.reads:
        if var.error is not None:
            return var.error
    if not op.overwrites:
        for var in op.writes:
            if var.error is not None:
                return var.error
    return None


# Until an operation has failed, no variable holds an error, and `execute` need not look for
# one to inherit (a loop over every read and write of every operation). Process-wide, as the
# variables are: they outlive a switch of engines. Set to True, from any thread, by a single
# store that no race can lose, as soon as an operation fails; set back to False only where no
# variable holds a failure any more (`forget_failures`): each was overwritten, or freed.
an_operation_failed = False
failed = weakref.WeakSet()        # the variables that hold a failure now


def failure(name, cause):
    """The `OperationError` of operation `name`, which raised `cause`: from now on, operations
    look for a failure to inherit (`execute`)."""
    global an_operation_failed
    an_operation_failed = True
    return OperationError(name, cause)


def set_error(var, error):
    """Fail `var` with `error`, or, with None, clear its failure (an overwrite succeeded)."""
    global an_operation_failed
    var.error = error
    if error is not None:
        failed.add(var)
        an_operation_failed = True
    else:
        failed.discard(var)


def forget_failures():
    """Stop looking for failures to inherit once no variable holds one. Called where no
    operation is failing meanwhile (the threaded engine holds its lock, with nothing in
    flight), so that a failure on its way to a variable is not missed."""
    global an_operation_failed
    an_operation_failed = len(failed) > 0


def skipped(op):
    """Whether `op`, skippable and inheriting a failure, is skipped: where only what it reads
    failed (a gradient), what it updates in place (a weight, its optimizer state) keeps its
    values, and stays good, rather than fail for good with it. The failure still surfaces: at
    the wait on what failed (the loss), or at `wait_all`, which keeps it since it happened."""
    return all(var.error is None for var in op.writes)


def execute(op, where, launch=None, catching=(Exception, KeyboardInterrupt)):
    """Run one operation as every engine does; return (its error or None, whether its own).

    An operation that inherits a failure does not run; `launch(op)` runs it where given (a GPU
    stream's way, the naive engine's), else `op.fn()`. The record gets `where` and the times.
    What `catching` names fails the operation; by default a KeyboardInterrupt too, so that its
    lane goes on: on the threaded engine that is the operation's own doing, never Ctrl-C (a
    waiting main thread that runs operations holds Ctrl-C back until they are done,
    `interrupts.CtrlC`). The naive engine runs operations on the caller's thread and lets Ctrl-C
    through as itself: what the operation writes is not failed, and the next cell works."""
    record = op.record
    if record is not None:
        record.worker, record.start = where, time.perf_counter()
    error = inherited_error(op) if an_operation_failed else None
    if error is not None and op.skippable and skipped(op):
        return None, False
    own = error is None
    try:
        if own:
            try:
                if launch is None:
                    op.fn()
                else:
                    launch(op)
            except catching as cause:  # noqa: BLE001 - any failure travels on
                error = failure(op.name, cause)
    finally:
        if record is not None:
            record.end = time.perf_counter()
    return error, own and error is not None
