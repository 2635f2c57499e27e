"""Keys and what the stores say about them, one way for every store: a call's (key, value)
pairs, the one key type a store takes, a key's name in a states file, an array described in
an error."""
import re


def pairs(key, value, first_key=None):
    """[(key, value)] of one key, or of a list of keys with a list of values, after checking the
    keys' types against the store's first key (None while the store is empty)."""
    if isinstance(key, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            length = len(value) if hasattr(value, '__len__') else 1
            raise ValueError(f'{len(key)} keys need a list of {len(key)} values, got '
                             f'{type(value).__name__} of length {length}')
        found = list(zip(key, value))
    else:
        found = [(key, value)]
    check_key_types([k for k, _ in found], first_key)
    return found


def as_list(value):
    """The arrays of one key's value: a list of arrays, one a device, or one array."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_key_types(keys, first_key=None):
    """Refuse keys that are not ints or strings, or not all of the type of the store's first
    key (`first_key`, None while the store is empty; then the call's first key decides)."""
    for key in keys:
        if not isinstance(key, (int, str)) or isinstance(key, bool):
            raise TypeError(f'keys are ints or strings, not {key!r}')
        first_key = key if first_key is None else first_key
        if type(key) is not type(first_key):
            raise TypeError(f'mixed key types are not allowed: key {key!r} is a '
                            f'{type(key).__name__}, but this store\'s keys are '
                            f'{type(first_key).__name__}s (key {first_key!r} came first); '
                            'a store takes int keys or str keys, not both, as in MXNet')


def state_name(key):
    """A key as the name of its entry in a states file: its type and its text, so that 3 and
    '3' stay apart ('int:3', 'str:3'). Every store writes and reads this one encoding."""
    return f'{type(key).__name__}:{key}'


def key_of_state(name):
    """The key whose states `name` holds: state_name undone."""
    kind, _, text = name.partition(':')
    if kind == 'int' and re.fullmatch(r'-?[0-9]+', text):
        return int(text)
    if kind == 'str':
        return text
    raise ValueError(f'{name!r} is not a key written by save_optimizer_states (it writes '
                     "'int:3' for key 3 and 'str:w' for key 'w')")


def describe(array):
    """An array (or None) as an error message names it."""
    return 'nothing' if array is None else f'shape {tuple(array.shape)} {array.dtype}'
