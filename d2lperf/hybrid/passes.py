"""Passes: small functions that take a graph and return a better one computing the same thing.

Each pass copies its input, so the reader can print the graph before and after. `optimize`
runs them in the order a compiler would: fold what is known, merge what is repeated, drop
what is unused, then fuse elementwise chains so that each runs as one step. Memory planning,
the last pass, lives in `memory_plan.py`. Taught in "Compilers and Interpreters".
"""
import numpy

from ..ops import REGISTRY
from .graph import ARGUMENT_KINDS, Node

CHAIN_HEADS = ('elementwise', 'contraction')     # the op kinds a fused chain may start with


def eliminate_dead_code(graph):
    """Walk backwards from the outputs; keep what they need (and the arguments)."""
    graph = graph.copy()
    live, kept = set(graph.outputs), []
    for node in reversed(graph.nodes):
        if node in live or node.kind in ARGUMENT_KINDS:
            kept.append(node)
            live.update(node.input_nodes())
    graph.nodes = kept[::-1]
    return graph


def _scalar_key(x):
    """Python scalars by type and spelling, so that 1, 1.0, True and -0.0 stay apart."""
    return x if isinstance(x, Node) else (type(x), repr(x))


def _expression_key(node):
    """What makes two nodes compute the same value; None for nodes never to be merged."""
    if node.kind == 'constant':
        return ('constant', node.dtype.str, node.shape, numpy.asarray(node.value).tobytes())
    if node.kind != 'call' or node.op_kind == 'random':
        return None
    key = (node.op, tuple(map(_scalar_key, node.inputs)), tuple(sorted(node.attrs.items())))
    try:
        hash(key)
    except TypeError:                   # an attribute that cannot be compared safely
        return None
    return key


def eliminate_common_subexpressions(graph):
    """Compute each distinct expression once; later copies read the first (never random ops)."""
    graph = graph.copy()
    first, replaced, kept = {}, {}, []
    for node in graph.nodes:
        node.inputs = tuple(replaced.get(x, x) if isinstance(x, Node) else x for x in node.inputs)
        key = _expression_key(node)
        if key is not None and key in first:
            replaced[node] = first[key]
            continue
        if key is not None:
            first[key] = node
        kept.append(node)
    graph.nodes = kept
    graph.outputs = [replaced.get(n, n) for n in graph.outputs]
    return graph


def fold_constants(graph):
    """Compute, once and now, every operation whose inputs are all known constants."""
    graph = graph.copy()
    for node in graph.nodes:
        inputs = node.input_nodes()
        if (node.kind != 'call' or node.op_kind == 'random' or not inputs
                or any(x.kind != 'constant' for x in inputs)):
            continue
        values = [x.value if isinstance(x, Node) else x for x in node.inputs]
        value = numpy.asarray(REGISTRY[node.op].compute(numpy, *values, **node.attrs))
        node.kind, node.op, node.inputs, node.attrs = 'constant', None, (), {}
        node.value = value.astype(node.dtype, copy=False)
    return graph


def bind(graph, **values):
    """Turn the named inputs into constants: what a compiler does once it knows them."""
    graph = graph.copy()
    for node in graph.inputs:
        if node.name in values:
            value = numpy.asarray(values.pop(node.name), dtype=node.dtype)
            if value.shape != node.shape:
                raise ValueError(f'{node!r} is {node.type}, got a value of shape {value.shape}')
            node.kind, node.value = 'constant', value
    if values:
        raise ValueError(f'the graph has no inputs named {sorted(values)}')
    return graph


def _chain_from(node, users, outputs, taken):
    """`node` and the elementwise nodes after it that only it feeds: one fusable chain."""
    chain = [node]
    while chain[-1] not in outputs and len(users[chain[-1]]) == 1:
        successor = users[chain[-1]][0]
        if (successor.op_kind != 'elementwise' or successor in taken
                or successor.shape != node.shape or successor.dtype != node.dtype):
            break
        chain.append(successor)
    return chain


def fuse_elementwise(graph):
    """Group each chain like `dot -> add -> relu` into one fused node that writes one buffer."""
    graph = graph.copy()
    users, outputs = graph.users(), set(graph.outputs)
    tails, taken = {}, set()
    for node in graph.nodes:
        if node not in taken and node.op_kind in CHAIN_HEADS:
            chain = _chain_from(node, users, outputs, taken)
            if len(chain) > 1:
                tails[chain[-1]] = chain
                taken.update(chain)
    replaced, nodes = {}, []
    for node in graph.nodes:        # the fused node takes its tail's place: all inputs are ready
        node.inputs = tuple(replaced.get(x, x) if isinstance(x, Node) else x for x in node.inputs)
        if node in tails:
            replaced[node] = _fused_node(graph, tails[node])
            nodes.append(replaced[node])
        elif node not in taken:
            nodes.append(node)
    graph.nodes = nodes
    graph.outputs = [replaced.get(n, n) for n in graph.outputs]
    return graph


def _fused_node(graph, chain):
    members = set(chain)
    external = dict.fromkeys(x for m in chain for x in m.input_nodes() if x not in members)
    return Node(graph.fresh_name('fused'), 'fused', 'fused', list(external), {},
                chain[-1].shape, chain[-1].dtype, body=chain)


def simplify(graph):
    """The passes that keep one operation per node: what autograd and export work on."""
    graph = fold_constants(graph)
    graph = eliminate_common_subexpressions(graph)
    return eliminate_dead_code(graph)


def optimize(graph):
    """Every pass, in order: fold, merge, drop, then fuse."""
    return fuse_elementwise(simplify(graph))
