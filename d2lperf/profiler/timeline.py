"""A profile drawn as a timeline: one lane per worker, so that overlap can be seen."""
from .. import engine
from .records import lanes

COLORS = {engine.COMPUTE: '#3367d6', engine.COPY_IN: '#e8710a', engine.COPY_OUT: '#0f9d58'}


def plot(records=None, ax=None, label_ops=False):
    """A timeline: one lane per worker, a bar per operation (ms from the first start)."""
    import matplotlib.pyplot as plt
    rows = lanes(records)
    origin = min(start for row in rows.values() for start, _, _ in row)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.2))
    for y, (worker, row) in enumerate(sorted(rows.items(), reverse=True)):
        bars = [((s - origin) * 1e3, (e - s) * 1e3) for s, e, _ in row]
        ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=COLORS.get(row[0][2].lane, '#777'),
                       edgecolors='white', linewidth=0.5)
        if label_ops:
            for (x, width), (_, _, r) in zip(bars, row):
                ax.text(x + width / 2, y, r.name, ha='center', va='center', fontsize=7,
                        color='white', clip_on=True)
    ax.set_yticks(range(len(rows)), sorted(rows, reverse=True))
    ax.set_xlabel('time (ms)')
    ax.set_xlim(left=0)
    ax.grid(axis='x', alpha=0.3)
    return ax
