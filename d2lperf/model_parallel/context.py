"""Context parallelism: one long sequence split over c devices, each computing attention for
the queries it holds. Taught in "Long Sequences and Many Experts".

A query needs every key and value before it, which live on other devices. Three ways to bring
them:
- **the ring** (Liu et al. 2023, Ring Attention): in c steps every device's keys and values
  pass each device once, each device sending what it holds to the next one while it attends
  to it;
- **the all-gather** (Llama 3's choice): every device first receives every other's keys and
  values, then attends.
- **Ulysses** (DeepSpeed's, Jacobs et al. 2023), which trades the split: an all-to-all gives
  each device the whole sequence of 1/c of the heads, it attends, and an all-to-all gives the
  output back by tokens. It needs c to divide the heads, and it balances any mask.

In the first two a device attends its queries to one chunk of keys at a time, with tiled attention
(`ops/attention.py`), which also gives each query row its log-sum-exp L. Partial results
merge exactly: out = Σᵢ exp(Lᵢ − L) outᵢ with L = log Σᵢ exp(Lᵢ). Everything, the sends
included (`comm.send`), is recorded, so autograd gives q, k and v their gradients: each send's
gradient goes back the way it came. The price is memory: the tape keeps every chunk a device
received, as the all-gather does, where Ring Attention's own backward sends the keys and values
round again (with their gradients) so as to hold two chunks at a time.

Under a causal mask a contiguous split gives the last device the most work, 2 − 1/c times the
average. The zig-zag layout cuts the sequence into 2c chunks and gives device i chunks i and
2c − 1 − i: an early and a late one, the same work everywhere (`counted_work`).
"""
from __future__ import annotations

from fractions import Fraction

import numpy

from .. import autograd, comm, np
from ..np import extension as npx
from ..engine import profiler
from ..np.multiarray import apply
from ..ops.attention import check_shapes

LAYOUTS = ('zigzag', 'contiguous')
ALGORITHMS = ('ring', 'all_gather', 'ulysses')
FULL, DIAGONAL = 'full', 'diagonal'


# -- which chunks a device holds, and which blocks of scores it computes ------------------------

def num_chunks(devices, layout):
    """Chunks the sequence is cut into: one a device, or two with the zig-zag."""
    return 2 * devices if layout == 'zigzag' else devices


def chunks_of(rank, devices, layout):
    """The chunks of the sequence device `rank` holds (its queries, keys and values)."""
    return [rank, 2 * devices - 1 - rank] if layout == 'zigzag' else [rank]


def mask_between(query_chunk, key_chunk, causal):
    """How a chunk of queries sees a chunk of keys: whole ('full'), under the causal mask
    ('diagonal': the same positions), or not at all (None: every key is in the future)."""
    if not causal or key_chunk < query_chunk:
        return FULL
    return DIAGONAL if key_chunk == query_chunk else None


def attention_blocks(rank, devices, layout='zigzag', causal=True):
    """The (query chunk, key chunk, mask) blocks of scores device `rank` computes: each of
    its chunks of queries against every chunk of keys the mask leaves it."""
    return [(i, j, mask_between(i, j, causal)) for i in chunks_of(rank, devices, layout)
            for j in range(num_chunks(devices, layout)) if mask_between(i, j, causal)]


def counted_work(devices, layout='zigzag', causal=True):
    """Each device's share of the (seq, seq) matrix of scores, exact: a chunk-by-chunk block
    is 1/chunks² of it, a diagonal block under the causal mask half of that (as FLOPs are
    counted for causal attention)."""
    area = Fraction(1, num_chunks(devices, layout) ** 2)
    return [sum(area / 2 if mask == DIAGONAL else area
                for _, _, mask in attention_blocks(rank, devices, layout, causal))
            for rank in range(devices)]


def imbalance(work):
    """max / mean: how much longer the busiest device works than the average one."""
    return max(work) * len(work) / sum(work)


# -- what moves --------------------------------------------------------------------------------

def ring_bytes_per_step(shape, devices, dtype='float32'):
    """Bytes one device sends in one step of the ring: its keys' and values' chunks,
    2·batch·heads·(seq/c)·d elements. A forward pass takes c − 1 steps (the last chunk
    received is not sent on); backward, their gradients go back (`ring_gradient_bytes`)."""
    batch, heads, seq, width = shape
    return 2 * batch * heads * (seq // devices) * width * numpy.dtype(dtype).itemsize


def ring_gradient_bytes(shape, devices, layout='zigzag', causal=True, dtype='float32'):
    """{(step, rank): bytes} device `rank` sends back in the backward pass: the gradients of
    the keys and values it received at `step`, to the device they came from. Without a mask
    that is the forward's bytes again; under the causal mask a chunk that neither this device
    nor those it passes the chunk on to attends to has no gradient, and nothing goes back."""
    per_chunk = ring_bytes_per_step(shape, devices, dtype) // len(chunks_of(0, devices, layout))
    sent = {}
    for step in range(1, devices):
        for rank in range(devices):
            holders = [(rank + ahead) % devices for ahead in range(devices - step)]
            queries = [i for r in holders for i in chunks_of(r, devices, layout)]
            used = [j for j in chunks_of((rank - step) % devices, devices, layout)
                    if any(mask_between(i, j, causal) for i in queries)]
            if used:
                sent[step, rank] = per_chunk * len(used)
    return sent


def all_gather_bytes(shape, devices, dtype='float32'):
    """Bytes one device receives in the all-gather of keys and values: the c − 1 others'
    chunks, as many as c − 1 steps of the ring, but at once, and then held: every device
    holds all the keys and values, where the ring needs two chunks of them at a time."""
    return (devices - 1) * ring_bytes_per_step(shape, devices, dtype)


def ulysses_bytes(shape, devices, dtype='float32'):
    """Bytes one device sends in Ulysses' two all-to-alls: (c - 1)/c of its tokens of q, k
    and v, then of the output, 4(c - 1)·batch·heads·seq·d / c² elements, against the ring's
    2(c - 1)·batch·heads·seq·d / c: 2/c of it."""
    batch, heads, seq, width = shape
    return (4 * (devices - 1) * batch * (heads // devices) * (seq // devices) * width
            * numpy.dtype(dtype).itemsize)


def busy_per_device(records, devices):
    """Seconds each device's compute lane ran something, from the engine's records: with
    the zig-zag they come out alike; contiguous, the last device's is the longest."""
    rows = profiler.lanes(records)
    return [profiler.busy_time(rows.get(f'{device} compute', [])) for device in devices]


# -- the attention ----------------------------------------------------------------------------

def context_parallel_attention(q, k, v, devices, causal=True, layout='zigzag',
                               algorithm='ring'):
    """softmax(q kᵀ / √d) v for q, k, v (batch, heads, seq, d) on one device, computed with
    the sequence split over `devices`: the whole output, back on q's device.

    >>> q = d2l.np.random.normal(size=(1, 2, 8, 4))
    >>> out = d2l.model_parallel.context_parallel_attention(q, q, q, [d2l.cpu(0), d2l.cpu(1)])
    >>> bool(abs(out - d2l.npx.attention(q, q, q)).max() < 1e-5)
    True
    """
    devices = check(q, k, v, devices, layout, algorithm)
    queries, keys = scatter(q, k, v, devices, layout)
    outs = attend_chunks(queries, keys, devices, causal, algorithm)
    whole = {chunk: comm.send(out.astype(q.dtype), q.device, 'gather sequence', 0, chunk)
             for device_outs in outs for chunk, out in device_outs.items()}
    return np.concatenate([whole[chunk] for chunk in sorted(whole)], axis=2)


def attend_chunks(queries, keys, devices, causal, algorithm):
    """Per device, {chunk: the output of its queries}, from per device {chunk: queries} and
    [(chunk, keys, values)], by `algorithm`."""
    if algorithm == 'ulysses':
        return ulysses(queries, keys, devices, causal)
    gathered = ring(queries, keys, devices, causal) if algorithm == 'ring' else \
        attend_all(queries, all_gather_keys(keys, devices), causal)
    return [{i: out for i, (out, _) in parts.items()} for parts in gathered]


# -- inside a model: each device holds its zig-zag chunks from the start ----------------------

def own_chunks(x, rank, devices, axis=1):
    """Of a whole sequence along `axis`, device `rank`'s zig-zag chunks (rank and
    2c − 1 − rank), side by side: what it holds of every activation under context
    parallelism."""
    chunks = num_chunks(devices, 'zigzag')
    if x.shape[axis] % chunks:
        raise ValueError(f'a sequence of {x.shape[axis]} does not cut into {chunks} equal chunks '
                         f'(zig-zag over {devices} devices); use a length that is a multiple '
                         f'of {chunks}')
    size = x.shape[axis] // chunks
    return np.concatenate([along(x, axis, i * size, (i + 1) * size)
                           for i in chunks_of(rank, devices, 'zigzag')], axis=axis)


def along(x, axis, start, stop):
    return x[(slice(None),) * axis + (slice(start, stop),)]


def attention_of_chunks(packed, algorithm='ring'):
    """Causal attention for c devices that each hold their zig-zag chunks of q, k and v,
    packed side by side on the last axis ((batch, heads, tokens, 3d) a device, as
    `own_chunks` left them): each device's output for its queries. Recorded as one
    collective that keeps only the packed inputs: backward runs the attention again on the
    tape and walks it (`recomputed_gradients`), as Ring Attention sends the keys and values
    round again in its backward.

    >>> devices = [d2l.cpu(1), d2l.cpu(2)]
    >>> q = d2l.np.random.normal(size=(1, 2, 8, 4))
    >>> packed = [d2l.np.concatenate([own_chunks(x, r, 2, axis=2) for x in (q, q, q)], axis=-1)
    ...           .copyto(device) for r, device in enumerate(devices)]
    >>> outs = attention_of_chunks(packed)
    >>> whole = d2l.npx.attention(q, q, q)
    >>> bool(abs(outs[1].copyto(q.device) - own_chunks(whole, 1, 2, axis=2)).max() < 1e-5)
    True
    """
    with autograd.pause():
        outs = chunk_attention(packed, algorithm)
    return autograd.collective(
        outs, packed, lambda grads: recomputed_gradients(packed, grads, algorithm))


def chunk_attention(packed, algorithm):
    """Each device's output, (batch, heads, tokens, d), from its packed q, k and v."""
    devices, c = [x.device for x in packed], len(packed)
    width, size = packed[0].shape[-1] // 3, packed[0].shape[2] // 2
    queries, keys = [], []
    for rank, x in enumerate(packed):
        def piece(which, half):
            return x[:, :, half * size:(half + 1) * size, which * width:(which + 1) * width]
        mine = chunks_of(rank, c, 'zigzag')
        queries.append({chunk: piece(0, half) for half, chunk in enumerate(mine)})
        keys.append([(chunk, piece(1, half), piece(2, half)) for half, chunk in enumerate(mine)])
    outs = attend_chunks(queries, keys, devices, True, algorithm)
    return [np.concatenate([outs[rank][chunk].astype(x.dtype)
                            for chunk in chunks_of(rank, c, 'zigzag')], axis=2)
            for rank, x in enumerate(packed)]


def recomputed_gradients(packed, grads, algorithm):
    """The packed inputs' gradients, given the outputs' (`grads`, one a device): the
    attention run again on the tape from copies of the inputs, and one backward walk from
    Σ sum(output · gradient), its parts sent to the first device (a walk of its own, inside
    the walks of the devices' backward passes, which meet here)."""
    leaves = [x.copy() for x in packed]
    for leaf in leaves:
        leaf.attach_grad()
    first = packed[0].device
    with autograd.record():
        total = None
        for rank, (out, grad) in enumerate(zip(chunk_attention(leaves, algorithm), grads)):
            part = (out * grad).sum()
            part = part if out.device == first else \
                comm.send(part, first, 'attention backward', 0, rank)
            total = part if total is None else total + part
    total.backward()
    return [leaf.grad for leaf in leaves]


def whole_sequence(parts):
    """Every device's zig-zag chunks (axis 1) put back in order, the whole sequence on every
    device (the logits: each device computes the whole loss). Backward, each device keeps its
    own chunks' gradient of its own copy: every copy gets the whole loss's gradient, and
    summing them would count it c times."""
    c, size = len(parts), parts[0].shape[1] // 2
    with autograd.pause():
        pieces = {chunk: along(part, 1, half * size, (half + 1) * size)
                  for rank, part in enumerate(parts)
                  for half, chunk in enumerate(chunks_of(rank, c, 'zigzag'))}
        wholes = [np.concatenate([piece if piece.device == part.device else
                                  comm.send(piece, part.device, 'gather sequence', 0, chunk)
                                  for chunk, piece in sorted(pieces.items())], axis=1)
                  for part in parts]
    return autograd.collective(
        wholes, parts, lambda grads: [own_chunks(g, rank, c) for rank, g in enumerate(grads)])


def scatter(q, k, v, devices, layout):
    """Per device, {chunk: its queries} and [(chunk, its keys, its values)]."""
    size = q.shape[2] // num_chunks(len(devices), layout)
    queries, keys = [], []
    for rank, device in enumerate(devices):
        def to_device(x, chunk):
            return comm.send(x[:, :, chunk * size:(chunk + 1) * size], device,
                             'split sequence', 0, chunk)
        mine = chunks_of(rank, len(devices), layout)
        queries.append({i: to_device(q, i) for i in mine})
        keys.append([(i, to_device(k, i), to_device(v, i)) for i in mine])
    return queries, keys


def ring(queries, keys, devices, causal):
    """Ring Attention: at each of c steps a device attends to the chunks it holds, then
    sends them to the next device (and receives the previous one's). The sends of a step
    depend only on what was received, so the engine runs them during the attention."""
    parts = [{} for _ in devices]
    held = keys
    for step in range(len(devices)):
        for rank in range(len(devices)):
            attend(parts[rank], queries[rank], held[rank], causal)
        if step < len(devices) - 1:
            held = [pass_on(held[rank - 1], devices[rank], step + 1)
                    for rank in range(len(devices))]
    return parts


def pass_on(chunks, device, step):
    return [(j, comm.send(key, device, 'ring attention', step, j),
             comm.send(value, device, 'ring attention', step, j)) for j, key, value in chunks]


def all_gather_keys(keys, devices):
    """Every device's keys and values on every device, each sent once from its owner.
    Sends rather than `comm.all_gather`, whose backward (a reduce-scatter) would need the
    devices' backward walks to meet (`autograd.backward_together`): a send's gradient goes
    back on its own, inside one backward pass of the whole output."""
    return [[(j, key, value) if owner == rank else
             (j, comm.send(key, device, 'all-gather attention', 1, j),
              comm.send(value, device, 'all-gather attention', 1, j))
             for owner in range(len(devices)) for j, key, value in keys[owner]]
            for rank, device in enumerate(devices)]


def attend_all(queries, gathered, causal):
    return [attend({}, mine, chunks, causal) for mine, chunks in zip(queries, gathered)]


def attend(parts, queries, chunks, causal):
    """Attend each chunk of `queries` to each of `chunks` of keys its mask leaves it, merging
    into `parts` ({query chunk: (out, L)}); returns them."""
    for i, query in queries.items():
        for j, key, value in chunks:
            mask = mask_between(i, j, causal)
            if mask:
                part = block_attention(query, key, value, mask == DIAGONAL)
                parts[i] = part if i not in parts else merge(parts[i], part)
    return parts


def ulysses(queries, keys, devices, causal):
    """DeepSpeed-Ulysses: device j receives heads j of every chunk of q, k and v (an
    all-to-all), attends over the whole sequence for its heads, and returns each device the
    output of its chunks' tokens, heads j (an all-to-all back). Per device {chunk: out}."""
    some = next(iter(queries[0].values()))
    size, per = some.shape[2], some.shape[1] // len(devices)

    def by_heads(pieces, j):
        """The whole sequence of heads j on device j, from every device's chunks."""
        chunks = {i: move(x[:, j * per:(j + 1) * per], devices[j], 1, i)
                  for device_pieces in pieces for i, x in device_pieces.items()}
        return np.concatenate([chunks[i] for i in sorted(chunks)], axis=2)
    keys_by_chunk = [{i: key for i, key, _ in mine} for mine in keys]
    values_by_chunk = [{i: value for i, _, value in mine} for mine in keys]
    outs = [npx.attention(by_heads(queries, j), by_heads(keys_by_chunk, j),
                          by_heads(values_by_chunk, j), causal, block_size=size)
            for j in range(len(devices))]
    return [{i: np.concatenate([move(out[:, :, i * size:(i + 1) * size], device, 2, i)
                                for out in outs], axis=1) for i in queries[rank]}
            for rank, device in enumerate(devices)]


def move(x, device, step, chunk):
    """Ulysses' all-to-all, one piece at a time: a send unless the piece is home already."""
    return x if x.device == device else comm.send(x, device, 'ulysses attention', step, chunk)


def block_attention(q, k, v, causal):
    """(out, L) of one chunk of queries against one chunk of keys, in one tile: the tiled
    op's output holds each row's log-sum-exp beside it (one precision wider than q)."""
    rows = q.shape[2]
    packed = apply('attention', q, k, v, causal=causal, block_size=(rows, rows))
    width = q.shape[-1]
    return packed[..., :width], packed[..., width:]


def merge(first, second):
    """Two partial attentions of the same queries over disjoint keys, as one: each weighed
    by its share exp(Lᵢ − L) of the softmax's denominator."""
    (out_a, lse_a), (out_b, lse_b) = first, second
    top = np.maximum(lse_a, lse_b)                 # exp of what is left is at most 1
    weight_a, weight_b = np.exp(lse_a - top), np.exp(lse_b - top)
    total = weight_a + weight_b
    return (out_a * weight_a + out_b * weight_b) / total, top + np.log(total)


def check(q, k, v, devices, layout, algorithm):
    check_shapes(q, k, v)
    if layout not in LAYOUTS:
        raise ValueError(f'unknown layout={layout!r}; use one of {LAYOUTS}')
    if algorithm not in ALGORITHMS:
        raise ValueError(f'unknown algorithm={algorithm!r}; use one of {ALGORITHMS}')
    devices = list(devices)
    if not devices:
        raise ValueError('context parallelism needs at least one device')
    if algorithm == 'ulysses' and q.shape[1] % len(devices):
        raise ValueError(f'Ulysses splits the {q.shape[1]} heads over {len(devices)} devices: '
                         'use a number of devices that divides the heads, or the ring')
    chunks = num_chunks(len(devices), layout)
    if q.shape[2] % chunks:
        raise ValueError(f'a sequence of {q.shape[2]} does not cut into {chunks} equal chunks '
                         f'({layout} over {len(devices)} devices); use a length that is a '
                         f'multiple of {chunks}')
    return devices
