"""Draw the three ways to split training over devices, and one data-parallel step.

Run `python images/partitioning.py` (or `make figures`) to rewrite the two SVG files beside
this script; the chapter "Training on Multiple GPUs" shows them. Schematics, not measurements.
"""
import pathlib

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch

from schematic import BLUE, GREEN, ORANGE, RED, arrow, box, save

HERE = pathlib.Path(__file__).parent
DEVICE_COLORS = [BLUE, ORANGE, GREEN]


def layers_across_devices(ax):
    """Model parallelism by layers: each device owns consecutive layers."""
    for layer in range(4):
        device = layer // 2
        box(ax, 0.15, 0.08 + 0.22 * layer, 0.7, 0.16, f'layer {layer + 1}  (device {device})',
            DEVICE_COLORS[device])
        if layer:
            arrow(ax, (0.5, 0.08 + 0.22 * layer - 0.06), (0.5, 0.08 + 0.22 * layer))
    ax.set_title('split the layers', fontsize=9)


def layer_across_devices(ax):
    """Model parallelism within layers: each device computes part of every layer's outputs."""
    for layer in range(4):
        y = 0.08 + 0.22 * layer
        for device in range(2):
            box(ax, 0.08 + 0.43 * device, y, 0.4, 0.16, f'half of layer {layer + 1}',
                DEVICE_COLORS[device])
        if layer:
            for a in range(2):
                for b in range(2):
                    arrow(ax, (0.28 + 0.43 * a, y - 0.06), (0.28 + 0.43 * b, y))
    ax.set_title('split every layer', fontsize=9)


def data_across_devices(ax):
    """Data parallelism: every device runs the whole network on part of the minibatch."""
    for device in range(2):
        x = 0.08 + 0.46 * device
        for layer in range(4):
            box(ax, x, 0.08 + 0.22 * layer, 0.36, 0.16, f'layer {layer + 1}',
                DEVICE_COLORS[device])
        ax.text(x + 0.18, -0.04, 'half the batch', ha='center', fontsize=7)
    ax.add_patch(FancyArrowPatch((0.45, 0.82), (0.53, 0.82), arrowstyle='<|-|>', mutation_scale=9,
                                 color=RED, linewidth=1.2))
    ax.text(0.5, 1.1, 'gradients summed\nonce per batch', ha='center', va='top', fontsize=7,
            color=RED)
    ax.set_title('split the data', fontsize=9)


def data_parallel_step(ax):
    """One training step on two devices, left to right."""
    stages = ['split the\nminibatch', 'forward and\nbackward', 'sum the\ngradients',
              'copy the sum\nback', 'update\nparameters']
    for i, stage in enumerate(stages):
        x = 0.02 + 0.2 * i
        if i in (2, 3):
            box(ax, x, 0.3, 0.14, 0.4, stage, RED)
        else:
            for device in range(2):
                box(ax, x, 0.55 - 0.45 * device, 0.14, 0.35, stage, DEVICE_COLORS[device])
        if i:
            arrow(ax, (x - 0.05, 0.5), (x - 0.01, 0.5))
    for device in range(2):
        ax.text(-0.01, 0.72 - 0.45 * device, f'device {device}', rotation=90, va='center',
                ha='right', fontsize=8, color=DEVICE_COLORS[device])


def main():
    fig, axes = plt.subplots(1, 3, figsize=(9, 3))
    for ax, draw in zip(axes, [layers_across_devices, layer_across_devices, data_across_devices]):
        draw(ax)
        ax.set_xlim(0, 1), ax.set_ylim(-0.06, 1.1), ax.axis('off')
    save(fig, HERE / 'partitioning.svg')
    fig, ax = plt.subplots(figsize=(8, 2.2))
    data_parallel_step(ax)
    ax.set_xlim(-0.03, 1), ax.set_ylim(0, 1), ax.axis('off')
    save(fig, HERE / 'data_parallel_step.svg')


if __name__ == '__main__':
    main()
