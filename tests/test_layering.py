"""The package's stated layering is its code.

`ls d2lperf/` is the course's table of contents, and the package docstring lists its entries
(modules and folders) in the order the chapters teach them, then states them again as layers,
bottom first (`utils < device < ...`). Here both are checked against the tree (every entry
named once, nothing named that is not there), every import against the layers (a module
imports only from its own entry or from one below it), every folder's modules against each
other (no import cycle inside a folder), and every module against its neighbours' private
names. The launcher imports nothing of the package: it must run where d2lperf's dependencies
are not installed yet."""
import ast
import pathlib
import re

import numpy
import pytest

import d2lperf

PACKAGE = pathlib.Path(d2lperf.__file__).parent


def listed():
    """The entries the package docstring lists by chapter ('engine', not 'engine/')."""
    return re.findall(r'^    (\w+)/? {2,}', d2lperf.__doc__, flags=re.MULTILINE)


def stated_order():
    """The entries in the docstring's chain of layers, bottom first."""
    chain = d2lperf.__doc__.split('Layers, bottom first:')[1]
    return re.findall(r'\w+', chain)


def entries():
    """The modules and folders at the top of the package, but its __init__."""
    return {p.stem for p in PACKAGE.iterdir()
            if (p.suffix == '.py' and p.stem != '__init__')
            or (p.is_dir() and (p / '__init__.py').exists())}


def modules():
    """{path: (its entry, its dotted name inside the package)} for every file but __init__."""
    found = {}
    for path in sorted(PACKAGE.rglob('*.py')):
        parts = path.relative_to(PACKAGE).with_suffix('').parts
        if parts != ('__init__',):
            found[path] = parts[0], '.'.join(p for p in parts if p != '__init__')
    return found


def imports(path):
    """(imported dotted name inside the package, line, inside a function?) for each import."""
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
                name = target + [alias.name] if not node.module else target
                yield '.'.join(name), node.lineno, id(node) in inner
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [
                a.name for a in node.names]
            for name in filter(None, names):
                assert name.split('.')[0] != 'd2lperf', \
                    f'{path.relative_to(PACKAGE)}:{node.lineno} imports d2lperf absolutely'


def test_the_docstring_lists_every_entry_of_the_package_once():
    assert sorted(listed()) == sorted(entries())


def test_the_docstring_layers_every_entry_of_the_package_once():
    order = stated_order()
    assert sorted(order) == sorted(entries())
    assert order[:2] == ['utils', 'device'] and order.index('engine') < order.index('np')


def test_every_import_goes_to_its_own_entry_or_one_listed_above():
    rank = {name: i for i, name in enumerate(stated_order())}
    upward = []
    for path, (entry, _) in modules().items():
        for target, line, _ in imports(path):
            if rank[target.split('.')[0]] > rank[entry]:
                upward.append(f'{path.relative_to(PACKAGE)}:{line} imports {target}')
    assert upward == []


def test_no_folder_has_an_import_cycle():
    """Inside a folder too the modules form layers: no module imports, at module level, one
    that imports it back (directly or around a circle)."""
    graph = {}
    for path, (entry, name) in modules().items():
        if path.name == '__init__.py':
            continue
        graph[name] = {target for target, _, in_function in imports(path)
                       if not in_function and target.split('.')[0] == entry and target != entry
                       and target != name}
    state = {}

    def visit(name, stack):
        if state.get(name) == 'done':
            return
        assert state.get(name) != 'open', f'import cycle: {" -> ".join(stack + [name])}'
        state[name] = 'open'
        for target in graph.get(name, ()):
            visit(target, stack + [name])
        state[name] = 'done'
    for name in graph:
        visit(name, [])


def test_the_launcher_imports_nothing_of_the_package():
    assert [target for target, _, _ in imports(PACKAGE / 'launch.py')] == []


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


def declared_fields(tree):
    """The fields that a module's classes declare: as class attributes (`__slots__` names
    them), or by assigning `self.field`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for statement in filter(lambda n: isinstance(n, ast.Assign), node.body):
                assigned = {n.id for t in statement.targets for n in ast.walk(t)
                            if isinstance(n, ast.Name)}
                names |= assigned
                if '__slots__' in assigned:
                    names |= {e.value for e in ast.walk(statement.value)
                              if isinstance(e, ast.Constant)}
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id == 'self'):
            names.add(node.attr)
    return names


def reached_fields(tree):
    """(field, line) for each field a module reaches on another object than its own: by name
    through getattr, hasattr, setattr or delattr, or by assigning `other.field`."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ('getattr', 'hasattr', 'setattr', 'delattr')
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id == 'self')):
            yield node.args[1].value, node.lineno
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id not in ('self', 'cls')):
            yield node.attr, node.lineno


def imported_names(tree):
    """The names a module binds by importing from the package (`TAPE`, `engine`)."""
    return {alias.asname or alias.name for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level for alias in node.names}


def writes_into_imported(tree):
    """(what, line) for each field a module writes or deletes on an object it imported from
    another module of the package: `TAPE.walk = backward`, `engine.x += 1`, `setattr(TAPE,
    ...)`."""
    names = imported_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in names:
                yield ast.unparse(node), node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ('setattr', 'delattr') and node.args
              and isinstance(node.args[0], ast.Name) and node.args[0].id in names):
            yield ast.unparse(node), node.lineno


def test_a_module_fills_another_modules_slots_only_through_a_declared_hook():
    """A layer above hands a lower one what only it can provide (autograd's reverse walk, the
    compiler's tracer) by calling a function the lower module declares for it (np/tape.py:
    `register_backward`, `tracing`, `modes`), an import this file checks like any other. A
    write into a field of an imported object (`TAPE.walk = backward`, as autograd.py once
    did; `TAPE.tracer = tracer`, as hybrid/trace.py did) fills a lower module's slot from
    above with no import to show it, and no name a reader can look up."""
    written = [f'{path.relative_to(PACKAGE)}:{line} writes {what}'
               for path in modules() for what, line in writes_into_imported(
                   ast.parse(path.read_text()))]
    assert written == []


def test_the_tape_holds_what_the_layers_above_registered():
    """The registrations the test above asks for, seen from the tape's side: autograd's walk
    is in place once the package is imported, and a trace's tracer only while it traces; the
    hook takes only what declares the interface it asks of a tracer (`tape.Tracing`)."""
    from d2lperf import autograd
    from d2lperf.hybrid.trace import Spec, Tracer, trace
    from d2lperf.np.tape import TAPE, Tracing, tracing
    seen = []
    assert TAPE.walk is autograd.backward and TAPE.tracer is None
    trace(lambda x: seen.append(TAPE.tracer) or x + 1, [Spec((2,))])
    assert isinstance(seen[0], Tracer) and TAPE.tracer is None
    assert issubclass(Tracer, Tracing)
    with pytest.raises(TypeError, match='tracing takes a Tracing'):
        with tracing(object()):
            pass


# What every layer may ask of an array, NumPy's, CuPy's or NDArray alike (shape, dtype, ...).
ARRAY_PROTOCOL = set(dir(numpy.ndarray))


def test_no_layer_reaches_a_field_that_only_a_layer_above_declares():
    """An import shows a dependency; duck typing hides one: device.py once read and wrote the
    `released` field of np's HeldVar through getattr, importing nothing. A field that no
    class of a module's layer or below declares is a layer above's to read and write."""
    rank = {name: i for i, name in enumerate(stated_order())}
    layer = {path: rank[entry] for path, (entry, _) in modules().items()}
    trees = {path: ast.parse(path.read_text()) for path in layer}
    lowest = {}                                 # field -> the lowest layer that declares it
    for path, tree in trees.items():
        for field in declared_fields(tree) - ARRAY_PROTOCOL:
            lowest[field] = min(lowest.get(field, layer[path]), layer[path])
    upward = [f'{path.relative_to(PACKAGE)}:{line} reaches .{field}'
              for path, tree in trees.items() for field, line in reached_fields(tree)
              if lowest.get(field, -1) > layer[path]]
    assert upward == []


def test_the_top_level_stays_short_enough_to_read_as_a_table_of_contents():
    """At most 18 entries besides __init__, the 18 that design.md's layout names (inference/
    the last to come): a new concept goes into the folder of the layer it belongs to, or a
    folder replaces several modules."""
    assert len(entries()) <= 18, sorted(entries())


def test_the_tracker_imports_nothing_of_the_policies_that_run_operations():
    """engine/tracking.py decides when an operation may run, apart from what runs it (MXNet's
    split, and the module's docstring): of the engine it imports the lane names alone, a
    module that starts no thread and holds no worker (it once imported workers.py for one)."""
    imported = {target for target, _, _ in imports(PACKAGE / 'engine' / 'tracking.py')}
    assert imported <= {'engine.lanes'}, imported
