"""A profile drawn as a timeline: one lane per worker, so that overlap can be seen."""
from ... import engine
from .records import lanes

COLORS = {engine.COMPUTE: '#3367d6', engine.COPY_IN: '#e8710a', engine.COPY_OUT: '#0f9d58'}
HIGHLIGHT = '#d62728'


def plot(records=None, ax=None, label_ops=False, highlight=None):
    """A timeline: one lane per worker, a bar per operation (ms from the first start).

    Bars take their lane's colour. `highlight`, a pair (label, predicate), draws the operations
    for which predicate(record) is true in one more colour, at least 1/200 of the time span
    wide so that short ones show, and a legend names the colours.
    """
    import matplotlib.pyplot as plt
    rows = lanes(records)
    origin = min(start for row in rows.values() for start, _, _ in row)
    span = max(end for row in rows.values() for _, end, _ in row) - origin
    shortest = span * 1e3 / 200               # ms: the narrowest a highlighted bar is drawn
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.2))
    marked = highlight[1] if highlight else (lambda record: False)
    for y, (worker, row) in enumerate(sorted(rows.items(), reverse=True)):
        bars = [((s - origin) * 1e3, max((e - s) * 1e3, shortest if marked(r) else 0))
                for s, e, r in row]
        lane_color = COLORS.get(row[0][2].lane, '#777')
        ax.broken_barh(bars, (y - 0.35, 0.7), edgecolors='white', linewidth=0.5,
                       facecolors=[HIGHLIGHT if marked(r) else lane_color for _, _, r in row])
        if label_ops:
            for (x, width), (_, _, r) in zip(bars, row):
                ax.text(x + width / 2, y, r.name, ha='center', va='center', fontsize=7,
                        color='white', clip_on=True)
    if highlight:
        _legend(ax, {row[0][2].lane for row in rows.values()}, highlight[0])
    ax.set_yticks(range(len(rows)), sorted(rows, reverse=True))
    ax.set_xlabel('time (ms)')
    ax.set_xlim(left=0)
    ax.grid(axis='x', alpha=0.3)
    return ax


def _legend(ax, lanes_drawn, label):
    from matplotlib.patches import Patch
    handles = [Patch(color=COLORS[lane], label=lane) for lane in COLORS
               if lane in lanes_drawn] + [Patch(color=HIGHLIGHT, label=label)]
    ax.legend(handles=handles, fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1))
