"""The drawing kit the scripts in images/ share: one palette, rounded boxes, arrows, and a save
that writes the same bytes every time (no date, a fixed hash salt), so that `make figures`
changes a file only when its drawing changed. Not a drawing script itself: it has no main().
"""
import matplotlib

matplotlib.use('svg')
import matplotlib.pyplot as plt                         # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch   # noqa: E402

BLUE, ORANGE, GREEN, RED, GRAY, PURPLE = ('#4C72B0', '#DD8452', '#55A868', '#C44E52',
                                          '#8C8C8C', '#8172B3')
matplotlib.rcParams.update({'svg.hashsalt': 'd2lperf', 'font.size': 9})


def box(ax, x, y, w, h, text, color, text_color='white', size=8, alpha=0.9):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle='round,pad=0.01,rounding_size=0.05',
                                facecolor=color, edgecolor='white', alpha=alpha))
    ax.text(x + w / 2, y + h / 2, text, ha='center', va='center', color=text_color,
            fontsize=size)


def arrow(ax, start, end, color='#444', style='-|>', width=1.0, **kwargs):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=9, color=color,
                                 linewidth=width, **kwargs))


def save(fig, path):
    fig.savefig(path, metadata={'Date': None}, bbox_inches='tight')
    plt.close(fig)
