"""The package's stated layering is its code: read every module's imports and check them
against the order of the package docstring, and check that no module reads another's
private names."""
import ast
import pathlib
import re

import d2lperf

PACKAGE = pathlib.Path(d2lperf.__file__).parent
# Modules the docstring names inside another's line, in their own order of imports.
WITHIN = {'ndarray': ['ndarray', 'np', 'npx'], 'hardware': ['hardware_gpu', 'hardware', 'hardware_io']}
REACHING_UP = {('ndarray', 'autograd'),       # NDArray.attach_grad and backward, when called
               ('kvstore', 'kvstore_dist')}   # a distributed store, when one is created


def stated_order():
    """The modules the package docstring lists, in its order."""
    return re.findall(r'^    (\w+) {2,}', d2lperf.__doc__, flags=re.MULTILINE)


def import_order():
    return [name for line in stated_order() for name in WITHIN.get(line, [line])]


def modules():
    """{path: top-level module name} for every file of the package but its __init__."""
    found = {}
    for path in sorted(PACKAGE.rglob('*.py')):
        parts = path.relative_to(PACKAGE).with_suffix('').parts
        if parts != ('__init__',):
            found[path] = parts[0]
    return found


def imported_modules(path):
    """(top-level d2lperf module, line, inside a function?) for each import in `path`."""
    parts = path.relative_to(PACKAGE).with_suffix('').parts
    package = list(parts[:-1])
    tree = ast.parse(path.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Lambda))]
    inner = {id(n) for f in functions for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)]
            target = base + (node.module.split('.') if node.module else [])
            for alias in node.names:
                top = (target + [alias.name])[0]
                yield top, node.lineno, id(node) in inner
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [
                a.name for a in node.names]
            for name in filter(None, names):
                if name.split('.')[0] == 'd2lperf':
                    assert False, f'{path.name}:{node.lineno} imports d2lperf absolutely'


def test_every_module_is_described_in_the_package_docstring():
    order = stated_order()
    assert order[:3] == ['utils', 'device', 'blas'] and 'trainer' in order
    assert set(modules().values()) <= set(import_order())
    assert all(name in d2lperf.__doc__ for name in import_order())


def test_every_import_goes_to_a_layer_listed_above():
    rank = {name: i for i, name in enumerate(import_order())}
    upward = []
    for path, name in modules().items():
        for target, line, in_function in imported_modules(path):
            if target == name or rank[target] < rank[name]:
                continue
            if in_function and (name, target) in REACHING_UP:
                continue
            upward.append(f'{path.relative_to(PACKAGE)}:{line} imports {target}')
    assert not upward


def private_attributes(tree):
    """Names `_x` that a module's own code sets or reads on `self`."""
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id in ('self', 'cls')
            and n.attr.startswith('_') and not n.attr.startswith('__')}


def test_no_module_reads_another_modules_private_names():
    trees = {path: ast.parse(path.read_text()) for path in modules()}
    own = {path: private_attributes(tree) for path, tree in trees.items()}
    everyone = set().union(*own.values())
    reaching = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                reaching += [f'{path.name}:{node.lineno} imports {a.name}'
                             for a in node.names if a.name.startswith('_')]
            if (isinstance(node, ast.Attribute) and node.attr in everyone - own[path]
                    and not (isinstance(node.value, ast.Name) and node.value.id in ('self', 'cls'))):
                reaching.append(f'{path.name}:{node.lineno} reads .{node.attr}')
            if isinstance(node, ast.Constant) and node.value in everyone - own[path]:
                reaching.append(f'{path.name}:{node.lineno} names {node.value!r}')
    assert not reaching
