"""Draw the schematics of the chapter "Parameter Servers": a 4-GPU server behind one PCIe
switch, the two rings of an 8-GPU NVLink server, the seven steps of multi-machine training,
and parameter servers that each hold a shard of the keys.

Run `python images/parameter_servers.py` (or `make figures`) to rewrite the four SVG files
beside this script. Schematics, not measurements: the chapter's cells measure and model.
"""
import math
import pathlib

import matplotlib.pyplot as plt

from schematic import BLUE, GRAY, GREEN, ORANGE, PURPLE, RED, arrow, box, save

HERE = pathlib.Path(__file__).parent
TWO_RINGS = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 4, 6, 3, 5, 8, 2, 7])   # the source's decomposition


def pcie_server(ax):
    """Four GPUs and the CPU on one PCIe switch; every link the same 16 GB/s each way."""
    box(ax, 3.0, 3.1, 2.0, 0.7, 'CPU', ORANGE)
    box(ax, 6.2, 3.1, 1.6, 0.7, 'network card', GRAY, size=7)
    box(ax, 2.6, 1.75, 2.8, 0.6, 'PCIe switch', PURPLE)
    for i in range(4):
        x = 0.4 + 1.9 * i
        box(ax, x, 0.1, 1.3, 0.7, f'GPU {i}', BLUE)
        arrow(ax, (x + 0.65, 0.8), (3.0 + 0.65 * i, 1.75), style='<|-|>', color=PURPLE)
    arrow(ax, (4.0, 2.35), (4.0, 3.1), style='<|-|>', color=PURPLE)
    arrow(ax, (6.2, 3.45), (5.0, 3.45), style='<|-|>', color=GRAY)
    ax.text(4.1, 2.65, '16 GB/s', fontsize=7.5, color=PURPLE)
    ax.text(0.0, 1.25, 'each link 16 GB/s\n(PCIe 3.0 x16)', fontsize=7.5, color=PURPLE)
    ax.text(5.6, 3.95, '0.1 to 10 GB/s', fontsize=7.5, color=GRAY)
    ax.set_xlim(-0.2, 8.2), ax.set_ylim(0, 4.2)


def ring_positions(count, radius=1.0):
    return [(radius * math.cos(math.pi / 2 - 2 * math.pi * i / count),
             radius * math.sin(math.pi / 2 - 2 * math.pi * i / count)) for i in range(count)]


def two_rings(axes):
    """The same eight GPUs, once with each ring drawn on its own."""
    places = ring_positions(8)
    for ax, ring, color, width, title in zip(
            axes, TWO_RINGS, (GREEN, BLUE), (3.2, 1.4),
            ('ring 1: two NVLinks between neighbours', 'ring 2: one NVLink')):
        for a, b in zip(ring, ring[1:] + ring[:1]):
            (xa, ya), (xb, yb) = places[a - 1], places[b - 1]
            ax.plot([xa, xb], [ya, yb], color=color, linewidth=width, zorder=1)
        for i, (x, y) in enumerate(places):
            ax.add_patch(plt.Circle((x, y), 0.17, color=GRAY, zorder=2))
            ax.text(x, y, str(i + 1), ha='center', va='center', color='white', fontsize=8,
                    zorder=3)
        ax.text(0, -1.45, title + '\n' + '-'.join(map(str, ring + ring[:1])), ha='center',
                fontsize=8)
        ax.set_xlim(-1.4, 1.4), ax.set_ylim(-1.75, 1.3), ax.set_aspect('equal')


def multi_machine(ax):
    """The seven steps of one synchronous step across machines, numbered as the text lists."""
    box(ax, 3.2, 4.1, 2.6, 0.6, 'parameter server', RED)
    for machine, x in enumerate((0.2, 5.4)):
        ax.add_patch(plt.Rectangle((x, 0.0), 3.4, 3.3, fill=False, edgecolor=GRAY,
                                   linestyle='--'))
        ax.text(x + 0.1, 3.05, f'machine {machine}', fontsize=7.5, color=GRAY)
        box(ax, x + 1.0, 2.2, 1.4, 0.55, 'CPU', ORANGE)
        for g in range(3):
            box(ax, x + 0.2 + 1.05 * g, 0.25, 0.9, 0.55, f'GPU {g}', BLUE, size=7)
            arrow(ax, (x + 0.65 + 1.05 * g, 0.8), (x + 1.7, 1.25), color=BLUE, width=0.8)
        arrow(ax, (x + 1.5, 1.35), (x + 1.5, 2.2), color=BLUE)
        arrow(ax, (x + 1.9, 2.2), (x + 1.9, 1.35), color=GREEN)
        arrow(ax, (x + 1.45, 2.75), (4.1 if machine == 0 else 4.6, 4.1), color=BLUE)
        arrow(ax, (4.3 if machine == 0 else 4.9, 4.1), (x + 1.95, 2.75), color=GREEN)
    labels = {1: (0.05, 0.95), 2: (1.0, 1.0), 3: (1.15, 1.7), 4: (2.2, 3.5), 5: (4.05, 3.75),
              6: (2.05, 1.7), 7: (2.45, 1.0)}
    for step, (x, y) in labels.items():
        ax.add_patch(plt.Circle((x, y), 0.16, color=PURPLE))
        ax.text(x, y, str(step), ha='center', va='center', color='white', fontsize=7)
    ax.plot([], [], color=BLUE, label='gradients (steps 1 to 4)')
    ax.plot([], [], color=GREEN, label='weights (steps 5 to 7)')
    ax.legend(loc='upper right', fontsize=7.5, frameon=False)
    ax.set_xlim(-0.1, 9.0), ax.set_ylim(-0.1, 4.9)


def sharded_servers(ax, workers=4, servers=3):
    """Every worker talks to every server; each server holds a third of the keys."""
    for s in range(servers):
        box(ax, 0.6 + 2.4 * s, 2.4, 1.8, 0.6, f'server {s}\nkeys {s}, {s + servers}, ...',
            RED, size=7)
    for w in range(workers):
        x = 0.2 + 2.0 * w
        box(ax, x, 0.1, 1.4, 0.55, f'worker {w}', BLUE, size=7)
        for s in range(servers):
            ax.plot([x + 0.7, 1.5 + 2.4 * s], [0.65, 2.4], color=GRAY, linewidth=0.6)
    ax.text(7.4, 1.5, 'm workers x n servers:\neach link carries 1/n\nof the parameters',
            fontsize=7.5, ha='left')
    ax.set_xlim(0, 9.6), ax.set_ylim(0, 3.2)


def main():
    for name, draw, size in (('pcie_server.svg', pcie_server, (6, 3.0)),
                             ('multi_machine.svg', multi_machine, (7.5, 4.0)),
                             ('sharded_servers.svg', sharded_servers, (7.5, 2.6))):
        fig, ax = plt.subplots(figsize=size)
        draw(ax)
        ax.axis('off')
        save(fig, HERE / name)
    fig, axes = plt.subplots(1, 2, figsize=(7, 3.6))
    two_rings(axes)
    for ax in axes:
        ax.axis('off')
    save(fig, HERE / 'two_rings.svg')


if __name__ == '__main__':
    main()
