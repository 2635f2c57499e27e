"""Draw the GPU schematics of the chapter "Hardware": a streaming multiprocessor and the chip
it is repeated on, a tensor core's operation, and the links inside a multi-GPU server.

Run `python images/gpu.py` (or `make figures`) to rewrite the three SVG files beside this
script. Schematics in the proportions of the V100 (NVIDIA's white paper), not
measurements: the chapter's cells measure this machine's GPU, if it has one.
"""
import pathlib

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

from schematic import BLUE, ORANGE, GREEN, RED, GRAY, PURPLE, box, save

HERE = pathlib.Path(__file__).parent


def unit_grid(ax, x, y, columns, rows, size, color):
    """A block of identical arithmetic units, one small square each."""
    for i in range(columns * rows):
        ax.add_patch(Rectangle((x + (i % columns) * size, y + (i // columns) * size),
                               size * 0.8, size * 0.8, facecolor=color, edgecolor='none'))


def processing_block(ax, x, y):
    """A quarter of an SM: its own scheduler and registers, 32 threads per instruction."""
    ax.add_patch(Rectangle((x, y), 2.3, 3.1, facecolor='#f2f2f2', edgecolor=GRAY))
    box(ax, x + 0.1, y + 2.65, 2.1, 0.35, 'warp scheduler', BLUE, size=6.5)
    box(ax, x + 0.1, y + 2.2, 2.1, 0.35, 'registers, 64 KiB', PURPLE, size=6.5)
    for column, (name, color) in enumerate((('INT32', GRAY), ('FP32', ORANGE),
                                            ('FP64', RED))):
        unit_grid(ax, x + 0.12 + 0.72 * column, y + 1.05, 4, 4 if name != 'FP64' else 2,
                  0.16, color)
        ax.text(x + 0.43 + 0.72 * column, y + 0.88, name, ha='center', fontsize=6)
    box(ax, x + 0.1, y + 0.1, 1.0, 0.6, 'tensor\ncore', GREEN, size=6.5)
    box(ax, x + 1.2, y + 0.1, 1.0, 0.6, 'tensor\ncore', GREEN, size=6.5)


def streaming_multiprocessor(ax):
    """One SM: four processing blocks sharing an instruction cache and the L1/shared memory."""
    box(ax, 0, 7.1, 9.6, 0.45, 'instruction cache', GRAY)
    for block in range(4):
        processing_block(ax, 0.05 + 2.4 * block, 3.8)
    box(ax, 0, 3.2, 9.6, 0.45, 'L1 data cache and shared memory (128 KiB)', GREEN, alpha=0.7)
    ax.text(4.8, 2.75, 'one SM: 64 FP32 units, 8 tensor cores', ha='center', fontsize=8)


def gpu_chip(ax, left=11.2):
    """GV100: six clusters of 14 SMs (84 SMs, 80 enabled on a V100), L2, HBM2, links."""
    disabled = {(0, 13), (2, 6), (3, 13), (5, 0)}     # for illustration: any four may be off
    for cluster in range(6):
        x, y = left + (cluster % 3) * 2.35, 4.7 if cluster < 3 else 0.9
        ax.add_patch(Rectangle((x, y), 2.2, 2.3, facecolor='#f2f2f2', edgecolor=GRAY))
        ax.text(x + 1.1, y + 2.1, f'cluster {cluster}', ha='center', fontsize=6.5)
        for sm in range(14):
            color = '#d0d0d0' if (cluster, sm) in disabled else BLUE
            ax.add_patch(Rectangle((x + 0.12 + (sm % 7) * 0.29, y + 0.25 + (sm // 7) * 0.8),
                                   0.23, 0.65, facecolor=color, edgecolor='none'))
    box(ax, left, 3.45, 6.9, 1.0, 'L2 cache (6 MiB), shared by all SMs', GREEN, alpha=0.7)
    for side, x in (('left', left - 0.9), ('right', left + 7.1)):
        for stack in range(2):
            box(ax, x, 1.5 + 3.4 * stack, 0.75, 2.2, 'HBM2\nstack', ORANGE, size=6.5)
    box(ax, left, 7.25, 3.3, 0.4, 'PCIe to the CPU', PURPLE, size=7)
    box(ax, left + 3.6, 7.25, 3.3, 0.4, 'NVLink to other GPUs', PURPLE, size=7)
    ax.text(left + 3.45, 0.35, 'the chip: 84 SMs (gray: switched off), 4 stacks of HBM2',
            ha='center', fontsize=8)


def sm_and_chip(ax):
    streaming_multiprocessor(ax)
    gpu_chip(ax)
    ax.set_xlim(-0.2, 19.2), ax.set_ylim(0.1, 7.8)


def matrix(ax, x, y, label, color, highlight=None, cell=0.32):
    """A 4 x 4 matrix of squares; `highlight` is ('row' or 'column' or 'cell', index)."""
    for i in range(4):
        for j in range(4):
            lit = highlight and ((highlight[0] == 'row' and i == highlight[1]) or
                                 (highlight[0] == 'column' and j == highlight[1]) or
                                 (highlight[0] == 'cell' and (i, j) == highlight[1]))
            ax.add_patch(Rectangle((x + j * cell, y + (3 - i) * cell), cell * 0.9, cell * 0.9,
                                   facecolor=color, alpha=0.95 if lit else 0.35,
                                   edgecolor='none'))
    ax.text(x + 2 * cell, y - 0.3, label, ha='center', va='top', fontsize=8)


def tensor_core(ax):
    """D = A B + C on 4 x 4 tiles: float16 products, float32 sums, in one operation."""
    matrix(ax, 0, 0, 'A\nfloat16', BLUE, ('row', 1))
    ax.text(1.6, 0.65, '×', ha='center', va='center', fontsize=14)
    matrix(ax, 1.9, 0, 'B\nfloat16', BLUE, ('column', 2))
    ax.text(3.5, 0.65, '+', ha='center', va='center', fontsize=14)
    matrix(ax, 3.8, 0, 'C\nfloat32', ORANGE, ('cell', (1, 2)))
    ax.text(5.4, 0.65, '=', ha='center', va='center', fontsize=14)
    matrix(ax, 5.7, 0, 'D\nfloat32', GREEN, ('cell', (1, 2)))
    ax.text(7.6, 0.95, 'each of the 16 results:\n4 products and 4 sums;\n'
            'all 64 multiply-adds\nin one clock cycle', va='center', fontsize=8)
    ax.set_xlim(-0.2, 9.8), ax.set_ylim(-1.0, 1.5)


def server_links(ax):
    """Eight GPUs in one server: NVLink among them, PCIe switches to the CPUs and network."""
    gpu_x = [0.15 + 1.35 * i for i in range(8)]
    for a, b in [(a, b) for quad in (range(4), range(4, 8)) for a in quad for b in quad
                 if a < b] + [(i, i + 4) for i in range(4)]:
        if b == a + 1:
            ax.plot([gpu_x[a] + 1.1, gpu_x[b]], [0.55, 0.55], color=GREEN, linewidth=1.6)
            continue
        bend = 0.45 if b - a == 4 else 0.25          # the links between the two groups of four
        ax.add_patch(FancyArrowPatch((gpu_x[a] + 0.55, 0.2), (gpu_x[b] + 0.55, 0.2),
                                     arrowstyle='-', color=GREEN, linewidth=1.6,
                                     connectionstyle=f'arc3,rad={bend}'))
    for i, x in enumerate(gpu_x):
        box(ax, x, 0.2, 1.1, 0.7, f'GPU {i}', BLUE)
    for switch in range(4):
        x = gpu_x[2 * switch] + 0.475
        box(ax, x, 1.9, 1.5, 0.55, 'PCIe switch', PURPLE, size=7)
        for gpu in (2 * switch, 2 * switch + 1):
            ax.plot([x + 0.75, gpu_x[gpu] + 0.55], [1.9, 0.9], color=PURPLE, linewidth=0.9,
                    linestyle='--')
        cpu_x = 1.6 if switch < 2 else 7.0
        ax.plot([x + 0.75, cpu_x + 1.0], [2.45, 3.3], color=PURPLE, linewidth=0.9,
                linestyle='--')
    for side, x in enumerate((1.6, 7.0)):
        box(ax, x, 3.3, 2.0, 0.7, f'CPU {side}', ORANGE)
    ax.plot([3.6, 7.0], [3.65, 3.65], color=ORANGE, linewidth=1.5)
    ax.text(5.3, 3.75, "the sockets' own link", ha='center', fontsize=7.5, color=ORANGE)
    for side, (x, switch_x) in enumerate(((-1.6, gpu_x[0] + 0.475), (10.9, gpu_x[6] + 1.975))):
        box(ax, x, 1.9, 1.4, 0.55, 'network\ncard', GRAY, size=7)
        ax.plot([x + 1.4 if side == 0 else x, switch_x], [2.17, 2.17], color=PURPLE,
                linewidth=0.9, linestyle='--')
    ax.plot([], [], color=GREEN, linewidth=1.6, label='NVLink, GPU to GPU')
    ax.plot([], [], color=PURPLE, linewidth=0.9, linestyle='--', label='PCIe')
    ax.legend(loc='lower center', ncol=2, fontsize=8, frameon=False)
    ax.set_xlim(-1.8, 12.5), ax.set_ylim(-2.2, 4.1)


def main():
    for name, draw, size in (('gpu_sm.svg', sm_and_chip, (10, 4.1)),
                             ('tensor_core.svg', tensor_core, (7, 2.0)),
                             ('gpu_server.svg', server_links, (8, 3.4))):
        fig, ax = plt.subplots(figsize=size)
        draw(ax)
        ax.axis('off')
        save(fig, HERE / name)


if __name__ == '__main__':
    main()
