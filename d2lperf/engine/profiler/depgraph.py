"""Draw the dependency graph the engine recorded: operations and the data they pass on.

`profiler.profile()` keeps, for every operation, the variables it read and wrote. Each write
makes a new *version* of a variable, so the graph is acyclic even with in-place updates:
an edge runs from the operation that wrote a version to every operation that read it.
`plot_dependencies` lays the operations out by depth; `plot_device_lanes` gives each device a
column of its own, so that work spread over devices, and the copies between them, show.
Used by "Asynchronous Computation" and "Automatic Parallelism".
"""


def dependency_edges(records):
    """(writer index, reader index, var id) for every read of a version some record wrote."""
    last_writer, edges = {}, []
    for i, record in enumerate(records):
        edges += [(last_writer[v], i, v) for v in record.reads if v in last_writer]
        edges += [(last_writer[v], i, v) for v in record.writes if v in last_writer]
        for v in record.writes:
            last_writer[v] = i
    return edges


def depths(records, edges):
    """Longest path from a source to each operation: the column it is drawn in."""
    depth = [0] * len(records)
    for writer, reader, _ in sorted(edges, key=lambda e: e[1]):
        depth[reader] = max(depth[reader], depth[writer] + 1)
    return depth


def as_late_as_possible(depth, edges):
    """Move each operation that depends on nothing down to just above its first reader."""
    has_input = {reader for _, reader, _ in edges}
    first_use = {}
    for writer, reader, _ in edges:
        first_use[writer] = min(first_use.get(writer, depth[reader]), depth[reader])
    return [d if i in has_input or i not in first_use else max(0, first_use[i] - 1)
            for i, d in enumerate(depth)]


def plot_dependencies(records, names=None, ax=None, label=None):
    """Operations as boxes in columns by depth; arrows carry the variable's name (if given)."""
    names = names or {}
    edges = dependency_edges(records)
    depth = depths(records, edges)
    rows = {}
    position = []
    for d in depth:
        position.append((d, -rows.get(d, 0)))
        rows[d] = rows.get(d, 0) + 1
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=(1.9 * (max(depth) + 1) + 1, 0.9 * max(rows.values()) + 1))
    for i, record in enumerate(records):
        text = label(record) if label else f'{record.name}\n{record.device}'
        ax.annotate(text, position[i], ha='center', va='center', fontsize=9,
                    bbox=dict(boxstyle='round', fc='#e8f0fe', ec='#3367d6'))
    for writer, reader, var in edges:
        (x0, y0), (x1, y1) = position[writer], position[reader]
        ax.annotate('', (x1 - 0.3, y1), (x0 + 0.3, y0),
                    arrowprops=dict(arrowstyle='->', color='#555'))
        if var in names:
            ax.text((x0 + x1) / 2, (y0 + y1) / 2 + 0.08, names[var], ha='center', fontsize=9,
                    color='#a33')
    outputs = {v for r in records for v in r.writes} - {e[2] for e in edges}
    for i, record in enumerate(records):
        for v in record.writes:
            if v in outputs and v in names:
                x, y = position[i]
                ax.annotate('', (x + 0.75, y), (x + 0.3, y),
                            arrowprops=dict(arrowstyle='->', color='#555'))
                ax.text(x + 0.8, y, names[v], va='center', color='#a33')
    ax.set_xlim(-0.6, max(depth) + 1.1)
    ax.set_ylim(-max(rows.values()) + 0.4, 0.6)
    ax.axis('off')
    return ax


def plot_device_lanes(records, names=None, ax=None, label=None):
    """One column per device, depth downwards: what each device ran, and what it waited for.

    Operations at the same depth in one column sit side by side; an arrow is a dependency
    (it crosses columns where a copy moved data between devices). `names` ({var id: name})
    labels what copies read and what any operation writes.
    """
    names = names or {}
    edges = dependency_edges(records)
    depth = as_late_as_possible(depths(records, edges), edges)
    cells = {}
    for i, record in enumerate(records):
        cells.setdefault((record.device, depth[i]), []).append(i)
    lanes = sorted({r.device for r in records}, key=lambda d: (d.kind != 'cpu', d.kind, d.index))
    width = {d: 0.9 * max(len(m) for (dev, _), m in cells.items() if dev == d) for d in lanes}
    column, x = {}, 0.0
    for d in lanes:
        column[d] = x + width[d] / 2
        x += width[d] + 0.3
    position = [None] * len(records)
    for (device, d), members in cells.items():
        for j, i in enumerate(members):
            position[i] = (column[device] + 0.9 * (j - (len(members) - 1) / 2), -d)
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=(1.1 * x + 0.3, 0.42 * (max(depth) + 1) + 0.8))
    for k, (device, middle) in enumerate(column.items()):
        half = width[device] / 2 + 0.1
        ax.axvspan(middle - half, middle + half, color=('#f3f6fb', '#fbf7f0')[k % 2], zorder=0)
        ax.text(middle, 1.0, str(device), ha='center', va='center', fontsize=10, weight='bold')
    for writer, reader, var in edges:
        ax.annotate('', position[reader], position[writer], zorder=1,
                    arrowprops=dict(arrowstyle='->', color='#888', lw=0.6, shrinkA=6, shrinkB=6))
    for i, record in enumerate(records):
        copy = record.lane != 'compute'
        text = label(record) if label else record.name
        if copy and set(record.reads) & set(names):
            text += ' ' + ', '.join(names[v] for v in record.reads if v in names)
        if set(record.writes) & set(names):
            text += ' → ' + ', '.join(names[v] for v in record.writes if v in names)
        ax.annotate(text, position[i], ha='center', va='center', fontsize=7, zorder=2,
                    bbox=dict(boxstyle='round,pad=0.2', ec='#e8710a' if copy else '#3367d6',
                              fc='#fde9d9' if copy else '#e8f0fe'))
    ax.set_xlim(-0.2, x - 0.1)
    ax.set_ylim(-max(depth) - 0.6, 1.4)
    ax.axis('off')
    return ax
