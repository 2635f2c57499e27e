"""Serialization: a graph as JSON, its parameters as NumPy `.npz`, and a loader that trusts nothing.

`save` writes `PREFIX-symbol.json` (nodes with op, name, attrs, inputs, shape and dtype; the
argument nodes; the heads; a format version) and `PREFIX-0000.params` (one array per
parameter), each atomically: a crash leaves the old file or the new one, never half of one.
`load` reads them back without executing anything from them: every op must be registered,
every name, attribute, shape and dtype is checked, every node's type is inferred again and
compared, and any problem is a `ValueError` that says what is wrong. Taught in "Compilers
and Interpreters".
"""
import inspect
import json
import math
import re
import zipfile

import numpy

from ..ops import REGISTRY
from ..utils import atomic_write
from .graph import Graph, Node

FORMAT, FORMAT_VERSION = 'd2lperf-symbol', 1
MAX_SYMBOL_BYTES = 64 << 20
MAX_ELEMENTS = 1 << 31
NAME = re.compile(r'[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}\Z')
DTYPES = frozenset({'bool', 'int8', 'int16', 'int32', 'int64', 'uint8', 'uint16', 'uint32',
                    'uint64', 'float16', 'float32', 'float64'})
NULL_KINDS = ('input', 'param', 'constant')
# The only words an attribute may hold: a symbol file names things, never runs them.
TEXT_ATTRIBUTES = {'dtype': DTYPES, 'pool_type': frozenset({'max', 'avg'})}


# -- writing -------------------------------------------------------------------------------

def encode_attr(value):
    if isinstance(value, tuple):
        return [encode_attr(v) for v in value]
    if isinstance(value, slice):
        return {'slice': [value.start, value.stop, value.step]}
    if value is Ellipsis:
        return {'ellipsis': True}
    if value is None or type(value) in (bool, int, float, str):
        return value
    raise TypeError(f'attribute value {value!r} cannot be exported')


def encode_node(node, index):
    entry = {'op': 'null' if node.kind in NULL_KINDS else node.op, 'name': node.name}
    if node.kind in NULL_KINDS:
        entry['kind'] = node.kind
    else:
        entry['attrs'] = {k: encode_attr(v) for k, v in node.attrs.items()}
    entry['inputs'] = [index[x] if isinstance(x, Node) else {'scalar': x} for x in node.inputs]
    entry.update(shape=list(node.shape), dtype=node.dtype.name)
    return entry


def to_json(graph):
    """The document `load` reads: one node per line, so that its head is readable."""
    if any(n.kind == 'fused' for n in graph.nodes):
        raise ValueError('export the graph before fusion: fused nodes are not operations')
    index = {node: i for i, node in enumerate(graph.nodes)}
    nodes = ',\n'.join('    ' + json.dumps(encode_node(n, index)) for n in graph.nodes)
    tail = {'arg_nodes': [index[n] for n in graph.nodes if n.kind in NULL_KINDS],
            'heads': [index[n] for n in graph.outputs], 'returns_tuple': graph.returns_tuple}
    return ('{\n  "format": "%s",\n  "format_version": %d,\n  "nodes": [\n%s\n  ],\n%s\n}\n'
            % (FORMAT, FORMAT_VERSION, nodes,
               ',\n'.join(f'  "{k}": {json.dumps(v)}' for k, v in tail.items())))


def write_npz(file, arrays):
    """What numpy.savez writes, but with any parameter name and never a pickle."""
    with zipfile.ZipFile(file, 'w', zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, value in arrays.items():
            with archive.open(f'{name}.npy', 'w', force_zip64=True) as member:
                numpy.lib.format.write_array(member, numpy.ascontiguousarray(value),
                                             allow_pickle=False)


def save(prefix, graph, values, epoch=0):
    """Write `PREFIX-symbol.json` and `PREFIX-EPOCH.params`; return both paths.

    `values` maps every param and constant node's name to a NumPy array."""
    symbol_file, param_file = f'{prefix}-symbol.json', f'{prefix}-{epoch:04d}.params'
    text = to_json(graph)
    stored = {n.name: values[n.name] for n in graph.nodes if n.kind in ('param', 'constant')}
    atomic_write(param_file, lambda f: write_npz(f, stored))
    atomic_write(symbol_file, lambda f: f.write(text.encode()))
    return symbol_file, param_file


# -- reading -------------------------------------------------------------------------------

def fail(where, problem):
    raise ValueError(f'{where}: {problem}')


def read_document(path):
    with open(path, 'rb') as file:
        data = file.read(MAX_SYMBOL_BYTES + 1)
    if len(data) > MAX_SYMBOL_BYTES:
        fail(path, f'larger than {MAX_SYMBOL_BYTES >> 20} MiB: not a symbol file')
    try:
        document = json.loads(data.decode('utf-8'))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        fail(path, f'not valid JSON ({err}); was it written by net.export()?')
    if not isinstance(document, dict) or document.get('format') != FORMAT:
        fail(path, f'not a d2lperf symbol file (no "format": "{FORMAT}")')
    version = document.get('format_version')
    if type(version) is not int or version < 1:
        fail(path, f'format_version must be a positive integer, not {version!r}')
    if version > FORMAT_VERSION:
        fail(path, f'written in format version {version} by a newer d2lperf; this one reads '
                   f'versions up to {FORMAT_VERSION}: upgrade d2lperf to load it')
    return document


def is_slice(parts):
    return type(parts) is list and len(parts) == 3 and all(p is None or type(p) is int
                                                           for p in parts)


def decode_attr(value, key):
    if value is None or type(value) in (bool, int, float):
        return value
    if type(value) is str:
        if value not in TEXT_ATTRIBUTES.get(key, ()):
            allowed = '; '.join(f'{k}: {", ".join(sorted(v))}' for k, v in TEXT_ATTRIBUTES.items())
            raise ValueError(f'attribute {key}={value!r}: text is only allowed as one of the '
                             f'known words ({allowed})')
        return value
    if type(value) is list:
        return tuple(decode_attr(v, key) for v in value)
    if type(value) is dict and list(value) == ['slice'] and is_slice(value['slice']):
        return slice(*value['slice'])
    if value == {'ellipsis': True}:
        return Ellipsis
    raise ValueError(f'attribute {key}={value!r} is not a number, dtype, list or slice')


def attr_names(op, count):
    """The keyword arguments an op takes besides its `count` inputs."""
    parameters = list(inspect.signature(op.compute).parameters.values())[1:]
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return {p.name for p in parameters if p.kind is p.KEYWORD_ONLY}
    return {p.name for p in parameters[count:]}


def check_type(entry):
    shape, dtype = entry.get('shape'), entry.get('dtype')
    if (type(shape) is not list or len(shape) > 32
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise ValueError(f'shape must be a list of non-negative integers, not {shape!r}')
    if math.prod(shape) > MAX_ELEMENTS:
        raise ValueError(f'shape {shape} has more than {MAX_ELEMENTS} elements')
    if type(dtype) is not str or dtype not in DTYPES:
        raise ValueError(f'dtype must be one of {sorted(DTYPES)}, not {dtype!r}')
    return tuple(shape), numpy.dtype(dtype)


def read_input(x, nodes):
    if type(x) is int and 0 <= x < len(nodes):
        return nodes[x]
    if type(x) is dict and list(x) == ['scalar'] and type(x['scalar']) in (bool, int, float):
        return x['scalar']
    raise ValueError(f'input {x!r} is neither an earlier node index nor {{"scalar": number}}')


def read_node(entry, nodes, input_names):
    """One node from its JSON entry, checked field by field; its type inferred again."""
    if type(entry) is not dict:
        raise ValueError('a node must be a JSON object')
    name, op = entry.get('name'), entry.get('op')
    if type(name) is not str or not NAME.match(name):
        raise ValueError(f'node name {name!r} is not a plain name (letters, digits, _ . -)')
    if any(n.name == name for n in nodes):
        raise ValueError(f'two nodes are named {name!r}')
    shape, dtype = check_type(entry)
    inputs = entry.get('inputs', [])
    if type(inputs) is not list:
        raise ValueError('inputs must be a list')
    inputs = [read_input(x, nodes) for x in inputs]
    if op == 'null':
        kind = entry.get('kind', 'param')
        if kind not in NULL_KINDS or inputs:
            raise ValueError(f'an argument node must have no inputs and a kind among '
                             f'{NULL_KINDS}, not {kind!r}')
        if name in input_names or kind == 'input':    # inputs are what the caller says
            kind = 'input' if name in input_names else 'param'
        return Node(name, kind, shape=shape, dtype=dtype)
    if type(op) is not str or op not in REGISTRY:
        raise ValueError(f'unknown op {op!r}: this d2lperf has no such operation')
    attrs = entry.get('attrs', {})
    if type(attrs) is not dict:
        raise ValueError('attrs must be a JSON object')
    allowed = attr_names(REGISTRY[op], len(inputs))
    if not set(attrs) <= allowed:
        raise ValueError(f'op {op!r} takes attributes {sorted(allowed)}, not {sorted(attrs)}')
    attrs = {k: decode_attr(v, k) for k, v in attrs.items()}
    try:
        inferred = REGISTRY[op].infer(*inputs, **attrs)
    except Exception as err:                    # noqa: BLE001 - any failure means a bad file
        raise ValueError(f'{op} cannot take these inputs and attributes: {err}') from None
    if (tuple(inferred[0]), numpy.dtype(inferred[1])) != (shape, dtype):
        raise ValueError(f'declares {dtype}{list(shape)} but its inputs give '
                         f'{numpy.dtype(inferred[1])}{list(inferred[0])}')
    return Node(name, 'call', op, inputs, attrs, shape, dtype)


def read_graph(document, input_names, where):
    entries = document.get('nodes')
    if type(entries) is not list or not entries:
        fail(where, '"nodes" must be a non-empty list')
    nodes = []
    for i, entry in enumerate(entries):
        try:
            nodes.append(read_node(entry, nodes, input_names))
        except ValueError as err:
            fail(where, f'node {i} ({entry.get("name") if type(entry) is dict else "?"}): {err}')
    heads = document.get('heads')
    if type(heads) is not list or not heads or \
            not all(type(h) is int and 0 <= h < len(nodes) for h in heads):
        fail(where, '"heads" must be a non-empty list of node indices')
    missing = set(input_names) - {n.name for n in nodes if n.kind == 'input'}
    if missing:
        fail(where, f'no argument node named {sorted(missing)}; the arguments are '
                    f'{[n.name for n in nodes if n.kind in NULL_KINDS]}')
    return Graph(nodes, [nodes[h] for h in heads], document.get('returns_tuple') is True)


def read_arrays(path):
    try:
        archive = numpy.load(path, allow_pickle=False)
        if not isinstance(archive, numpy.lib.npyio.NpzFile):
            raise ValueError('not an .npz archive of parameters')
        with archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, EOFError, zipfile.BadZipFile, ValueError) as err:
        fail(path, f'not a readable parameter file ({type(err).__name__}: {err})')


def check_arrays(graph, arrays, where):
    """Every param and constant node has an array of its declared shape and dtype; no extras."""
    needed = [n for n in graph.nodes if n.kind in ('param', 'constant')]
    for node in needed:
        if node.name not in arrays:
            fail(where, f'missing parameter {node.name!r} ({node.type})')
        value = arrays[node.name]
        if value.shape != node.shape:
            fail(where, f'parameter {node.name!r} has shape {list(value.shape)} in the file, '
                        f'but the symbol file declares {list(node.shape)}')
        if value.dtype != node.dtype:
            fail(where, f'parameter {node.name!r} is {value.dtype} in the file, '
                        f'but the symbol file declares {node.dtype}')
    extra = set(arrays) - {n.name for n in needed}
    if extra:
        fail(where, f'arrays that no node uses: {sorted(extra)[:5]}')


def load(symbol_file, input_names, param_file):
    """Read an exported model back: (graph, {param name: array}); constants go into the graph."""
    if isinstance(input_names, str):
        input_names = [input_names]
    document = read_document(symbol_file)
    graph = read_graph(document, list(input_names), symbol_file)
    arrays = read_arrays(param_file)
    check_arrays(graph, arrays, param_file)
    for node in graph.nodes:
        if node.kind == 'constant':
            node.value = arrays.pop(node.name)
    return graph, {n.name: arrays[n.name] for n in graph.nodes if n.kind == 'param'}
