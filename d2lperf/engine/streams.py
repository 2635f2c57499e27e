"""GPU streams and the CUDA events that order them.

On a GPU each lane of a device owns a CUDA stream (compute; host to device; device to host),
so that the GPU's copy engines work while its cores compute (`GpuLane`). A compute lane only
launches its kernels, and the engine counts the write done at once: the event recorded after
them, per variable (`write_events`), is what later readers on other streams wait for, and
what a thread that needs the values waits for (`synchronize`). The naive engine runs a GPU
operation and waits for it at once (`run_on_gpu_now`). Taught in "Automatic Parallelism".
"""
import collections
import weakref

from .lanes import COMPUTE

# A reader on the stream that wrote a variable runs after the write anyway, in stream order;
# one on another stream waits for the write's event.
write_events = weakref.WeakKeyDictionary()  # engine Var -> (stream, event) of its last write
gpu_lanes = []                                  # a GPU lane has started: events may exist


def synchronize(var):
    """Block until the kernels that last wrote `var` have finished (CPU work: nothing to do)."""
    if gpu_lanes:
        written = write_events.get(var)
        if written is not None:
            written[1].synchronize()


def run_on_gpu_now(device, op):
    """The naive engine's way: run `op` on `device`'s current stream and wait for it."""
    cupy = device.xp
    with cupy.cuda.Device(device.index):
        op.fn()
        cupy.cuda.get_current_stream().synchronize()
    for var in op.writes:
        write_events.pop(var, None)


class GpuLane:
    """How the worker of one GPU lane runs its operations: on a CUDA stream of its own, made
    current on the worker's thread, after the kernels of other streams that wrote what each
    operation reads."""

    def __init__(self, device, lane):
        self.stream = use_gpu_stream(device)
        self.copies = lane != COMPUTE
        self.launched = collections.deque()   # (event, op), kept alive until the event
        gpu_lanes.append(f'{device} {lane}')

    def launch(self, op):
        """Launch `op` on this lane's stream: after the kernels that wrote what it reads.

        A copy lane waits for its copy to finish, so the engine completes a copy only once
        the data has moved: later writers of its source (on any stream) cannot overtake it.
        A compute lane returns at once; the op (and so the arrays its closure holds) is
        kept until its kernels are done, so memory is never recycled under a running kernel.
        """
        stream = self.stream
        for var in op.reads:
            written = write_events.get(var)
            if written is not None and written[0] is not stream:
                stream.wait_event(written[1])
        record = op.record
        begin = stream.record() if record is not None else None
        op.fn()
        end = stream.record()
        if record is not None:
            record.events = (begin, end)
        if self.copies:
            end.synchronize()
            for var in op.writes:
                write_events.pop(var, None)
            return
        self.keep_until_done(end, op)
        for var in op.writes:
            write_events[var] = (stream, end)

    def keep_until_done(self, event, op):
        launched = self.launched
        while launched and launched[0][0].done:
            launched.popleft()
        launched.append((event, op))

    def synchronize(self):
        """Wait for this lane's stream to finish everything launched on it."""
        self.stream.synchronize()
        self.launched.clear()


def use_gpu_stream(device):
    """Make `device` current on this thread and give the thread a stream of its own."""
    cupy = device.xp
    cupy.cuda.Device(device.index).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.use()
    return stream
