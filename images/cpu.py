"""Draw the CPU schematics of the chapter "Hardware": a chip, a core's pipeline, SIMD lanes
and the coherence worst case.

Run `python images/cpu.py` (or `make figures`) to rewrite the four SVG files beside this
script. Schematics, not measurements: the chapter's cells measure this machine.
"""
import pathlib

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

from schematic import BLUE, ORANGE, GREEN, RED, GRAY, PURPLE, arrow, box, save

HERE = pathlib.Path(__file__).parent


def cpu_chip(ax):
    """Four cores and four L3 slices on a ring, with the memory and PCIe controllers."""
    ax.add_patch(FancyBboxPatch((1.2, 1.55), 7.6, 0.5, boxstyle='round,pad=0,rounding_size=0.25',
                                facecolor='none', edgecolor=GRAY, linewidth=3))
    ax.text(5, 1.8, 'ring interconnect', ha='center', va='center', color=GRAY, fontsize=8)
    for i in range(4):
        x = 1.5 + 1.8 * i
        box(ax, x, 2.5, 1.4, 1.1, f'core {i}\n\nL1i  L1d\nL2', BLUE)
        box(ax, x, 0.3, 1.4, 0.8, f'L3 slice {i}', GREEN)
        for y0, y1 in ((2.5, 2.05), (1.1, 1.55)):
            ax.plot([x + 0.7, x + 0.7], [y0, y1], color=GRAY, linewidth=2)
    box(ax, -1.6, 1.3, 2.2, 1.0, 'memory\ncontroller', ORANGE)
    box(ax, 9.4, 1.3, 2.2, 1.0, 'PCIe controller\n(system agent)', PURPLE)
    for x0, x1 in ((0.6, 1.2), (8.8, 9.4)):
        ax.plot([x0, x1], [1.8, 1.8], color=GRAY, linewidth=2)
    for j, name in enumerate(['DRAM channel 0', 'DRAM channel 1']):
        box(ax, -1.6, 3.0 + 0.55 * j, 2.2, 0.45, name, ORANGE, alpha=0.55, text_color='black')
    arrow(ax, (-0.5, 2.3), (-0.5, 3.0), style='<|-|>')
    for j, name in enumerate(['GPU (x16)', 'NVMe SSD (x4)', 'network card']):
        box(ax, 9.4, 2.8 + 0.5 * j, 2.2, 0.42, name, PURPLE, alpha=0.55, text_color='black')
    arrow(ax, (10.5, 2.3), (10.5, 2.8), style='<|-|>')
    ax.set_xlim(-1.8, 11.8), ax.set_ylim(0.1, 4.4)


def core_pipeline(ax):
    """Front end, out-of-order engine, execution ports, retirement."""
    box(ax, 0, 2.9, 1.6, 0.7, 'branch\npredictor', RED)
    box(ax, 0, 1.6, 1.6, 0.9, 'fetch\n(L1i cache)', BLUE)
    box(ax, 2.1, 1.6, 1.6, 0.9, 'decode into\nmicro-ops', BLUE)
    box(ax, 4.2, 1.6, 1.8, 0.9, 'rename and\nschedule\n(out of order)', BLUE)
    ports = ['integer ALU', 'ALU and branch', 'vector FMA', 'vector FMA',
             'load', 'load', 'store']
    for i, port in enumerate(ports):
        color = GREEN if port in ('load', 'store') else ORANGE
        box(ax, 6.6, 3.55 - 0.5 * i, 2.6, 0.42, f'port {i}: {port}', color, size=7)
        arrow(ax, (6.0, 2.05), (6.6, 3.76 - 0.5 * i), color=GRAY, width=0.6)
    box(ax, 6.6, -0.75, 2.6, 0.45, 'L1d cache', GREEN, alpha=0.55, text_color='black')
    arrow(ax, (7.9, -0.3), (7.9, 0.55), style='<|-|>', color=GREEN)
    box(ax, 9.8, 1.6, 1.7, 0.9, 'retire in\nprogram order', BLUE)
    for start, end in (((1.6, 2.05), (2.1, 2.05)), ((3.7, 2.05), (4.2, 2.05)),
                       ((0.8, 2.9), (0.8, 2.5)), ((9.2, 2.05), (9.8, 2.05))):
        arrow(ax, start, end)
    ax.plot([7.9, 7.9, 0.8], [3.97, 4.35, 4.35], color=RED, linewidth=1)
    arrow(ax, (0.8, 4.35), (0.8, 3.6), color=RED)
    ax.text(4.3, 4.45, 'branch resolved: on a mispredict, flush and fetch again', color=RED,
            ha='center', fontsize=7.5)
    ax.text(2.9, 0.95, 'front end: in order', ha='center', color=GRAY, fontsize=8)
    ax.text(4.6, -0.55, 'back end: several\nmicro-ops per cycle', ha='center', color=GRAY,
            fontsize=8)
    ax.set_xlim(-0.2, 11.7), ax.set_ylim(-0.9, 4.7)


def simd_lanes(ax):
    """One scalar add against one SIMD add of eight 16-bit integers in a 128-bit register."""
    a, b = [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]
    ax.text(-0.6, 3.6, 'scalar: one add\nper instruction', ha='right', va='center', fontsize=8)
    for row, (values, y) in enumerate(((a[:1], 3.7), (b[:1], 3.0))):
        box(ax, 0, y, 0.8, 0.5, str(values[0]), BLUE if row == 0 else ORANGE)
    box(ax, 1.4, 3.35, 0.8, 0.5, str(a[0] + b[0]), GREEN)
    ax.text(-0.15, 3.25, '+', ha='right', va='center', fontsize=11)
    arrow(ax, (0.9, 3.6), (1.35, 3.6))
    ax.text(-0.3, 1.15, 'SIMD: one add,\neight lanes', ha='right', va='center', fontsize=8)
    for lane in range(8):
        x = lane * 0.95
        box(ax, x, 1.9, 0.8, 0.45, str(a[lane]), BLUE)
        box(ax, x, 1.25, 0.8, 0.45, str(b[lane]), ORANGE)
        box(ax, x, 0.2, 0.8, 0.45, str(a[lane] + b[lane]), GREEN)
        arrow(ax, (x + 0.4, 1.2), (x + 0.4, 0.7), width=0.8)
    for y, name in ((2.12, 'register a'), (1.47, 'register b'), (0.42, 'a + b')):
        ax.text(7.75, y, name, va='center', fontsize=8, color='#333')
    ax.text(3.75, 2.6, '128 bits = 8 lanes of 16-bit integers', ha='center', fontsize=8,
            color='#333')
    ax.set_xlim(-2.2, 8.8), ax.set_ylim(0, 4.4)


def coherence_step(ax, y, caches, label, transfer=None):
    """One moment: each core's copy of the line, its state, and a line in transit."""
    ax.text(-0.2, y + 0.25, label, ha='right', va='center', fontsize=8)
    for core, (state, value) in enumerate(caches):
        x = 0.2 + 4.6 * core
        color = {'M': RED, 'S': GREEN, 'I': GRAY}[state]
        for word in range(8):
            mine = word == core
            box(ax, x + 0.42 * word, y, 0.38, 0.5, str(value[word]) if state != 'I' else '',
                color, alpha=0.9 if mine else 0.45, size=7)
        ax.text(x + 3.45, y + 0.25, {'M': 'modified', 'S': 'shared', 'I': 'invalid'}[state],
                va='center', fontsize=7.5, color=color)
    if transfer:
        arrow(ax, *transfer, color=RED, width=1.4)


def cache_coherence(ax):
    """Two cores increment counters in different words of one 64-byte line."""
    for core in range(2):
        box(ax, 0.2 + 4.6 * core, 4.1, 3.3, 0.5, f'core {core}: counter {core} is word {core}',
            BLUE)
    coherence_step(ax, 3.2, [('S', [0] * 8), ('S', [0] * 8)], 'both read')
    coherence_step(ax, 2.3, [('M', [1] + [0] * 7), ('I', [0] * 8)], 'core 0 writes')
    coherence_step(ax, 1.4, [('I', [0] * 8), ('M', [1, 1] + [0] * 6)], 'core 1 writes',
                   transfer=((3.5, 2.35), (4.75, 1.75)))
    coherence_step(ax, 0.5, [('M', [2, 1] + [0] * 6), ('I', [0] * 8)], 'core 0 writes',
                   transfer=((4.75, 1.45), (3.5, 0.85)))
    ax.text(4.0, 0.05, 'every write waits for the whole line to come back from the other core',
            ha='center', fontsize=8, color=RED)
    ax.set_xlim(-1.6, 9.3), ax.set_ylim(-0.1, 4.7)


def main():
    for name, draw, size in (('cpu_chip.svg', cpu_chip, (8, 3.0)),
                             ('core_pipeline.svg', core_pipeline, (8, 3.4)),
                             ('simd.svg', simd_lanes, (7, 2.6)),
                             ('cache_coherence.svg', cache_coherence, (7.5, 3.4))):
        fig, ax = plt.subplots(figsize=size)
        draw(ax)
        ax.axis('off')
        save(fig, HERE / name)


if __name__ == '__main__':
    main()
