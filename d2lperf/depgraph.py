"""Draw the dependency graph the engine recorded: operations and the data they pass on.

`engine.trace()` keeps, for every operation, the variables it read and wrote. Each write
makes a new *version* of a variable, so the graph is acyclic even with in-place updates:
an edge runs from the operation that wrote a version to every operation that read it.
Used by "Asynchronous Computation" and "Automatic Parallelism".
"""
import matplotlib.pyplot as plt


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
