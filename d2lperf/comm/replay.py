"""An allreduce replayed from the profiler's records of a real run: which devices' values every
chunk held after each step, and when each transfer ran, drawn. `transfers` is what
`transfers_in(records)` returns, in the order the operations were issued. `names` lists the
devices (or their names, `str(device)`) in allreduce order. Taught in "Parameter Servers".
"""


def index_of(names):
    """device -> its index in `names`: the transfers carry Devices, and `names` may hold the
    Devices or their names; a device and its name print alike."""
    indices = {str(name): index for index, name in enumerate(names)}
    return lambda device: indices[str(device)]


def chunk_states(transfers, names):
    """([(phase, step)], [state after it]): state[d][c] is the set of device indices whose
    values chunk c on device d holds. `names`: the devices (or their names), in allreduce
    order."""
    chunks = 1 + max(t['chunk'] for t in transfers)
    holds = [[{device} for _ in range(chunks)] for device in range(len(names))]
    phases = list(dict.fromkeys(t['phase'] for t in transfers))
    index = index_of(names)
    moves = {}                  # one entry per chunk moved: is it added in?
    for t in transfers:
        key = (phases.index(t['phase']), t['step'], t['chunk'], index(t['source']),
               index(t['target']))
        moves[key] = moves.get(key, False) or t['action'] not in ('send', 'set')
    steps, states = [], []
    for (phase, step, chunk, src, dst), combine in sorted(moves.items()):
        mine = holds[dst][chunk]
        holds[dst][chunk] = mine | holds[src][chunk] if combine else set(holds[src][chunk])
        if not steps or steps[-1] != (phases[phase], step):
            steps.append((phases[phase], step))
            states.append(None)
        states[-1] = [[set(c) for c in row] for row in holds]
    return steps, states


def draw_chunk_states(steps, states, names):
    """One panel a step: row a device, column a chunk, the digits the devices it holds (dark:
    all of them). Returns the figure."""
    import matplotlib.pyplot as plt
    import numpy
    n, chunks = len(names), len(states[0][0])
    fig, axes = plt.subplots(1, len(steps), figsize=(2 * len(steps), 2.4), squeeze=False)
    for ax, (phase, step), state in zip(axes[0], steps, states):
        counts = numpy.array([[len(chunk) for chunk in row] for row in state])
        ax.imshow(counts, cmap='Blues', vmin=0, vmax=n)
        for (d, c), count in numpy.ndenumerate(counts):
            ax.text(c, d, ''.join(str(j) for j in sorted(state[d][c])), ha='center',
                    va='center', fontsize=7, color='white' if count == n else 'black')
        ax.set_title(f'{phase}\nstep {step}', fontsize=8)
        ax.set_xticks(range(chunks), [f'c{c}' for c in range(chunks)], fontsize=7)
        ax.set_yticks(range(n), [f'{j}: {name}' for j, name in enumerate(names)]
                      if ax is axes[0][0] else [], fontsize=7)
    fig.tight_layout()
    return fig


def draw_transfers(transfers, names, ax=None):
    """A bar a transfer operation, on the row of the device it goes into, coloured by its
    step, in ms since the first began. Returns the axes."""
    import matplotlib.pyplot as plt
    import numpy
    order = list(dict.fromkeys((t['phase'], t['step']) for t in transfers))
    colors = plt.cm.viridis(numpy.linspace(0, 0.9, len(order)))
    origin = min(t['start'] for t in transfers)
    index = index_of(names)
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 2.6))
    for t in transfers:
        ax.broken_barh([((t['start'] - origin) * 1e3, (t['end'] - t['start']) * 1e3)],
                       (index(t['target']) - 0.35, 0.7),
                       color=colors[order.index((t['phase'], t['step']))])
    ax.set_yticks(range(len(names)), [f'into {name}' for name in names])
    ax.set_xlabel('ms since the first transfer')
    for color, (phase, step) in zip(colors, order):
        ax.plot([], [], color=color, lw=6, label=f'{phase} {step}')
    ax.legend(fontsize=7, ncol=2, loc='upper left', bbox_to_anchor=(1.01, 1))
    ax.figure.tight_layout()
    return ax
