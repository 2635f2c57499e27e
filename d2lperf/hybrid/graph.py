"""The compiler's intermediate representation: a typed program in A-normal form.

A `Graph` is a list of `Node`s in topological order: every node names one value, computed
by one operation from earlier values (or Python scalars), with its shape and dtype known.
Arguments (`input`, `param`) and `constant`s have no operation; `fused` nodes hold a short
chain of nodes that run as one step. `print(graph)` reads like the program it is, and
`evaluate` runs it, node by node, the slow and obviously correct way: it is the reference
every pass and the code generator are tested against.
"""
import numpy

from ..ops import REGISTRY, as_array, differentiable

ARGUMENT_KINDS = ('input', 'param')


class Node:
    """One value of the program: `name = op(inputs, **attrs)`, of a known shape and dtype."""

    __slots__ = ('name', 'kind', 'op', 'inputs', 'attrs', 'shape', 'dtype', 'value', 'body')

    def __init__(self, name, kind, op=None, inputs=(), attrs=None, shape=(), dtype=None,
                 value=None, body=None):
        self.name, self.kind, self.op = name, kind, op
        self.inputs, self.attrs = tuple(inputs), dict(attrs or {})
        self.shape, self.dtype = tuple(shape), numpy.dtype(dtype)
        self.value, self.body = value, body

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def op_kind(self):
        """What the compiler may do with this node's op (`ops.OP_KINDS`); None if not a call."""
        return REGISTRY[self.op].kind if self.kind == 'call' else None

    @property
    def type(self):
        return f'{self.dtype}{list(self.shape)}'

    def input_nodes(self):
        return [x for x in self.inputs if isinstance(x, Node)]

    def __repr__(self):
        return f'%{self.name}'


class Graph:
    """Nodes in topological order, and the nodes whose values the program returns."""

    def __init__(self, nodes=(), outputs=(), returns_tuple=False):
        self.nodes, self.outputs = list(nodes), list(outputs)
        self.returns_tuple = returns_tuple      # forward returned a tuple, not one array
        self._counts = {}

    # -- building ----------------------------------------------------------------------------
    def fresh_name(self, stem):
        taken = {n.name for n in self.nodes}
        while True:
            index = self._counts.get(stem, 0)
            self._counts[stem] = index + 1
            if f'{stem}{index}' not in taken:
                return f'{stem}{index}'

    def add(self, node):
        self.nodes.append(node)
        return node

    def call(self, op, inputs, attrs=None, name=None):
        """Append `op(inputs, **attrs)`, its shape and dtype inferred by the op's own rule."""
        attrs = attrs or {}
        shape, dtype = REGISTRY[op].infer(*inputs, **attrs)
        return self.add(Node(name or self.fresh_name(op), 'call', op, inputs, attrs, shape, dtype))

    # -- reading -----------------------------------------------------------------------------
    @property
    def arguments(self):
        return [n for n in self.nodes if n.kind in ARGUMENT_KINDS]

    @property
    def inputs(self):
        return [n for n in self.nodes if n.kind == 'input']

    @property
    def params(self):
        return [n for n in self.nodes if n.kind == 'param']

    def users(self):
        """For every node, the nodes that read it (a node reading a value twice counts once)."""
        users = {n: [] for n in self.nodes}
        for node in self.nodes:
            for x in dict.fromkeys(node.input_nodes()):
                users[x].append(node)
        return users

    def copy(self):
        """A copy whose nodes can be changed without touching this graph's."""
        mapping = {}

        def clone(node):
            body = None if node.body is None else [clone(m) for m in node.body]
            new = Node(node.name, node.kind, node.op, [mapping.get(x, x) if isinstance(x, Node)
                                                       else x for x in node.inputs],
                       node.attrs, node.shape, node.dtype, node.value, body)
            mapping[node] = new
            return new
        graph = Graph([clone(n) for n in self.nodes], [], self.returns_tuple)
        graph.outputs = [mapping[n] for n in self.outputs]
        graph._counts = dict(self._counts)
        return graph

    def __str__(self):
        arguments = ', '.join(f'{n!r}: {n.type}' for n in self.arguments)
        lines = [f'graph({arguments}):']
        lines += [line for n in self.nodes if n.kind not in ARGUMENT_KINDS
                  for line in format_node(n, '    ')]
        lines.append('    return ' + ', '.join(map(repr, self.outputs)))
        return '\n'.join(lines)

    __repr__ = __str__


def format_attrs(attrs):
    return ''.join(f', {k}={v!r}' for k, v in attrs.items())


def format_constant(value):
    value = numpy.asarray(value)
    return repr(value.item()) if value.size == 1 else f'<{value.size} values>'


def format_node(node, indent):
    """The lines that print one node: `%name: type = op(inputs, attrs)`."""
    head = f'{indent}{node!r}: {node.type} = '
    if node.kind == 'constant':
        return [head + f'constant({format_constant(node.value)})']
    args = ', '.join(map(repr, node.inputs))
    if node.kind == 'fused':
        steps = ' -> '.join(m.op for m in node.body)
        lines = [head + f'fused({args}) {{  # {steps}']
        lines += [f'{indent}    {m!r} = {m.op}({", ".join(map(repr, m.inputs))}'
                  f'{format_attrs(m.attrs)})' for m in node.body]
        return lines + [indent + '}']
    return [head + f'{node.op}({args}{format_attrs(node.attrs)})']


# -- the reference interpreter -------------------------------------------------------------

SAVED = object()     # evaluate(keep=True)'s key for what ops keep for their vjp (`Op.saves`)


def run_node(xp, node, values):
    """The value of one call or fused node, given the values of the nodes it reads."""
    def read(x):
        return values[x] if isinstance(x, Node) else x
    if node.kind == 'fused':
        for member in node.body:
            values[member] = run_node(xp, member, values)
        return values[node.body[-1]]
    op, attrs = REGISTRY[node.op], node.attrs
    if op.saves and SAVED in values:
        attrs = dict(attrs, saved=values[SAVED].setdefault(node, {}))
    return as_array(xp, op.compute(xp, *map(read, node.inputs), **attrs))


def evaluate(graph, xp, arguments, keep=False):
    """Run `graph` on `arguments` (one array per argument node, in order): the outputs.

    With `keep`, also return every node's value (autograd's backward reads them), and what
    ops keep for their vjp (under the key SAVED)."""
    values = dict(zip(graph.arguments, arguments))
    if len(values) != len(graph.arguments):
        raise ValueError(f'the graph takes {len(graph.arguments)} arguments, '
                         f'got {len(arguments)}')
    if keep:
        values[SAVED] = {}
    for node in graph.nodes:
        if node.kind == 'constant':
            values[node] = xp.array(node.value)         # a copy: callers may write to it
        elif node.kind not in ARGUMENT_KINDS:
            values[node] = run_node(xp, node, values)
    outputs = [values[n] for n in graph.outputs]
    return (outputs, values) if keep else outputs


def gradients(graph, xp, values, head, head_grad, needs=None):
    """Reverse mode over the graph: the gradient of `head` for every argument (None if none,
    or if `needs`, one bool per argument, says nobody wants it).

    The same rule as `autograd.backward`, walked differently: this runs inside ONE engine
    operation (a hybridized block's tape node), on raw arrays, over nodes already in
    topological order, where autograd sorts recorded arrays and pushes one engine operation
    per node."""
    wanted = needing_gradients(graph, needs)
    grads = {head: head_grad}
    for node in reversed(graph.nodes):
        if node.kind != 'call' or node not in grads or node not in wanted:
            continue
        g, op, attrs = grads[node], REGISTRY[node.op], node.attrs
        if op.vjp is None:
            raise RuntimeError(f"operation '{node.op}' has no gradient")
        if op.partial_vjp:
            attrs = dict(attrs, needs=tuple(isinstance(x, Node) and x in wanted
                                            for x in node.inputs))
        if op.saves:
            attrs = dict(attrs, saved=values.get(SAVED, {}).get(node, {}))
        inputs = [values[x] if isinstance(x, Node) else x for x in node.inputs]
        for x, grad in zip(node.inputs, op.vjp(xp, g, values[node], *inputs, **attrs)):
            if isinstance(x, Node) and x in wanted and grad is not None and differentiable(x.dtype):
                grads[x] = grad if x not in grads else grads[x] + grad
    return [grads.get(n) for n in graph.arguments]


def needing_gradients(graph, needs=None):
    """The arguments `needs` marks (all, if None) and every node computed from one of them:
    the nodes a gradient must reach."""
    wanted = {a for a, need in zip(graph.arguments, needs or [True] * len(graph.arguments))
              if need}
    for node in graph.nodes:
        if node.kind == 'call' and any(x in wanted for x in node.input_nodes()):
            wanted.add(node)
    return wanted
