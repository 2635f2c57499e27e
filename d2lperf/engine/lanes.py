"""Lanes: the threads a device's operations run on, by name, and which one runs a copy.

Every device has one worker per *lane*, as in MXNet's per-device engine: a compute lane, and
lanes that move data, so that a copy overlaps with computation that does not depend on it
(on a GPU each lane owns a CUDA stream: `streams.py`). An operation names its lane when it is
pushed; a copy's lane is `copy_lane`'s choice. Taught in "Automatic Parallelism".
"""
COMPUTE, COPY_IN, COPY_OUT = 'compute', 'copy in', 'copy out'


def copy_lane(source, target):
    """The (device, lane) that runs a copy: a GPU's copy stream if one side is a GPU.

    Data leaving a GPU goes on its copy-out stream; data entering a GPU from the host on its
    copy-in stream; between GPUs on the source's copy-out stream (it waits for the source's
    kernels); between CPU devices on the target's copy-in thread.
    """
    if source.kind == 'gpu':
        return source, COPY_OUT
    return target, COPY_IN
