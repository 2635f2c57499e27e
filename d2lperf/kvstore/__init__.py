"""The (key, value) store: push gradients, pull weights, and let the store decide where to sum.

Taught in "Parameter Servers" and "Distributed Training". A store keeps one value a key.
`push` hands it values, one a device, which it reduces (sums); `pull` copies the value into
arrays on any devices. Without an optimizer a push *replaces* the value by the sum of what was
pushed; with one (`set_optimizer`), the sum is a gradient and the store updates the value it
holds by the optimizer's rule. These are MXNet's rules, and every store follows them.

What differs between stores is only *where* the values live and the sums happen:

    base       what every store is (`KVStoreBase`), and `create(name)`: the store registered
               under that name; each backend registers itself
    local      the in-process stores, 'local' (every value on cpu(0)) and 'device' (each key
               on one of the devices that push it)
    keys       what every store says about keys: one key type a store, names in states files
    protocol   the wire format between worker and server processes (numbers and text, never
               pickles), and the deadline of every wait, from MPI's start on
    server     a server process: a slice of every key, sync rounds or async updates
    dist       the worker side of 'dist_sync', 'dist_device_sync' and 'dist_async' (MPI)

A refused call (unknown key, second init, wrong shape or dtype) raises before anything is
pushed, so it leaves the store as it was.
"""
from .base import KVStoreBase
from .keys import check_key_types, key_of_state, state_name       # noqa: F401
from .local import LOCAL_TYPES, KVStore

DIST_TYPES = ('dist_sync', 'dist_device_sync', 'dist_async')
TYPES = LOCAL_TYPES + DIST_TYPES         # every store, by MXNet's names
from .dist import DistKVStore            # noqa: E402 - it registers DIST_TYPES, named above

create = KVStoreBase.create   # 'local', 'device', 'dist_sync', 'dist_device_sync', 'dist_async'
