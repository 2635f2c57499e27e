"""What an allreduce costs: its schedule priced on a topology in the α-β model.

A message costs α (latency, seconds) plus its bytes over the bandwidth of the links it uses
(β = 1 / bandwidth). Each transfer of a schedule uses *resources*: on a switch (PCIe, Ethernet)
the sender's port out and the receiver's port in, each full duplex; on NVLink, every directed
link of the ring between the two devices. A step lasts as long as its busiest resource (its
bytes over its bandwidth, plus α a message through it); the steps run one after the other.
These are the standard costs of Thakur, Rabenseifner and Gropp (2005): the ring and the split
move 2(n-1)/n of the data through every port, the naive algorithm 2(n-1) times all of it
through the first device's. The PCIe server is the MXNet edition's ("Parameter Servers"):
160 MB of gradients take 60 ms on one GPU, 80 ms through the CPU, 15 ms split over the four
GPUs. NVLink is the V100's, 25 GB/s a link and direction (NVIDIA's whitepaper), which puts the
two rings of 8 V100s at about 3.7 ms; the MXNet edition's "about 6 ms" comes from 18 GB/s
(`NVLINK_MXNET_EDITION`) and from rounding the ring's (n-1)/n to 1. Latencies are assumptions
of the right order; the MXNet edition leaves them out (alpha=0). `half_time` prices the two
halves of an allreduce apart (reduce-scatter, all-gather). Taught in "Parameter Servers".
`all_to_all_time` prices the pairwise exchange of an all-to-all the same way: n - 1 steps, each
device sending 1/n of its array in each ("Long Sequences and Many Experts");
`all_to_all_across_time` the same exchange over devices in several machines.
"""
from __future__ import annotations

import collections
from typing import Sequence

import numpy

from .schedules import Schedule, Step, chunk_bounds, half, pairwise_exchange, schedule

GB = 1e9            # the MXNet edition's units: 160 MB / 16 GB/s = 10 ms
PCIE3_X16 = 16 * GB
NVLINK = 25 * GB    # one V100 NVLink, one direction: 6 links carry 300 GB/s, both ways together
# The MXNet edition's NVLink: it read the V100's 300 GB/s as 300 Gbit/s a link, both ways
# together (37.5 GB/s), so about 18 GB/s each way. Kept to reproduce its figures.
NVLINK_MXNET_EDITION = 18 * GB

Topology = collections.namedtuple('Topology', 'name devices port host ring alpha')
Topology.__doc__ = """Where the devices are and how fast they talk (bandwidths in bytes/s).

`port`: what a device sends, and at the same time receives, through its link to the switch
(PCIe or Ethernet). `host`: the same for the host's link (the CPU behind the switch, or a
server machine). `ring`: bytes/s each way between ring neighbours, every ring's links
together (None: no ring, devices talk through the switch). `alpha`: seconds a message.
"""


def pcie_server(devices: int = 4, bandwidth: float = PCIE3_X16,
                alpha: float = 5e-6) -> Topology:
    """The MXNet edition's 4-GPU server: each GPU on a PCIe switch, one 16x link to the CPU."""
    return Topology('PCIe switch', devices, bandwidth, bandwidth, None, alpha)


def nvlink_ring(devices: int = 8, links: int = 1, bandwidth: float = NVLINK,
                alpha: float = 3e-6) -> Topology:
    """GPUs in a ring, `links` NVLinks between neighbours; PCIe 3.0 x16 to the host."""
    return Topology(f'NVLink ring ({links} link{"s" * (links > 1)})', devices,
                    PCIE3_X16, PCIE3_X16, links * bandwidth, alpha)


def p3_two_rings(bandwidth: float = NVLINK, alpha: float = 3e-6) -> Topology:
    """The P3.16xlarge / DGX-1 decomposition: a ring of double NVLinks and one of single links.

    The data is split 2 : 1 between them so that both finish together, which makes them one
    ring of 3 links' bandwidth (each V100 has 6 NVLinks: 3 each way round).
    """
    return Topology('P3 two NVLink rings', 8, PCIE3_X16, PCIE3_X16, 3 * bandwidth, alpha)


def ethernet(machines: int = 4, bandwidth: float = 10e9 / 8,
             alpha: float = 50e-6) -> Topology:
    """Machines on one switch (10 GbE by default); the 'cpu' host is one more such machine."""
    return Topology('Ethernet', machines, bandwidth, bandwidth, None, alpha)


def allreduce_time(algorithm: str, size_bytes: int, topology: Topology) -> float:
    """Seconds `algorithm` takes to allreduce `size_bytes` on each of `topology`'s devices."""
    return plan_time(schedule(algorithm, topology.devices), algorithm, size_bytes, topology)


def half_time(collective: str, algorithm: str, size_bytes: int, topology: Topology) -> float:
    """Seconds a 'reduce-scatter' or an 'all-gather' of `size_bytes` (each device's whole
    array) takes by `algorithm` ('ring' or 'split'): half of the allreduce each, as sharded
    training pays them."""
    return plan_time(half(collective, algorithm, topology.devices), algorithm, size_bytes,
                     topology)


def all_to_all_time(size_bytes: int, topology: Topology) -> float:
    """Seconds an all-to-all of `size_bytes` (each device's whole array) takes by the pairwise
    exchange: on a switch, (n - 1)(α + size / (n · bandwidth)), since every step keeps each
    device's port out and port in busy with one chunk; on a ring, each chunk takes the
    shorter way round, so the far chunks share links and cost more."""
    return plan_time(pairwise_exchange(topology.devices), 'all-to-all', size_bytes, topology)


def all_to_all_across_time(size_bytes: float, devices: int, per_machine: int,
                           inside: float, across: float, alpha: float) -> float:
    """Seconds an all-to-all of `size_bytes` (each device's whole array) takes over `devices`
    that sit `per_machine` to a machine: each device sends a 1/n chunk to each of the others,
    the m - 1 in its machine over NVLink (`inside` bytes/s) and the n - m in others over its
    network link (`across`). The two links are separate hardware and run at once, so the
    exchange lasts as long as the slower of the two, (m - 1)(α + size/(n·inside)) or
    (n - m)(α + size/(n·across)): in one machine, `all_to_all_time` on a switch of `inside`."""
    mates = min(devices, per_machine)
    chunk = size_bytes / devices
    return max((mates - 1) * (alpha + chunk / inside),
               (devices - mates) * (alpha + chunk / across))


def plan_time(plan: Schedule, algorithm: str, size_bytes: int, topology: Topology) -> float:
    """Seconds a schedule takes: its steps, one after the other, priced on `topology`."""
    if size_bytes < 0:
        raise ValueError(f'size_bytes must be at least 0, not {size_bytes}')
    if plan.parties > topology.devices and topology.host is None:
        raise ValueError(f'{topology.name} has no host link; give the topology a host '
                         f'bandwidth to price {algorithm!r}')
    chunk_bytes = [stop - start for start, stop in chunk_bounds(size_bytes, plan.chunks)]
    return sum(step_time(step, chunk_bytes, topology) for step in plan.steps)


def step_time(step: Step, chunk_bytes: Sequence[int], topology: Topology) -> float:
    """How long one step takes: its busiest resource's bytes over bandwidth, plus α a message."""
    load, messages = collections.Counter(), collections.Counter()
    for move in step.transfers:
        for resource, bandwidth in resources(move.source, move.target, topology):
            load[resource] += chunk_bytes[move.chunk] / bandwidth
            messages[resource] += 1
    return max(load[r] + topology.alpha * messages[r] for r in load)


def resources(source: int, target: int, topology: Topology) -> list[tuple[tuple, float]]:
    """[(resource, bandwidth)] that a transfer from party `source` to `target` uses.

    On a ring fabric, data between devices takes the shorter way round, over every link on
    it; everything else (and data to or from the host) goes through the two ports.
    """
    n = topology.devices
    if topology.ring is None or source >= n or target >= n:
        return [(('out', source), _port(source, topology)),
                (('in', target), _port(target, topology))]
    way = 1 if (target - source) % n <= (source - target) % n else -1
    hops, here = [], source
    while here != target:
        hops.append((('link', here, (here + way) % n), topology.ring))
        here = (here + way) % n
    return hops


def _port(party, topology):
    return topology.port if party < topology.devices else topology.host


def bus_bandwidth(size_bytes: float, seconds: float, devices: int) -> float:
    """nccl-tests' bus bandwidth of an allreduce: size / time · 2(n-1)/n, in bytes/s.

    It is what each device's link carried, so it can be set against the link's bandwidth
    whatever the number of devices.
    """
    return size_bytes / seconds * 2 * (devices - 1) / devices


def fit_alpha_beta(sizes_bytes: Sequence[float],
                   seconds: Sequence[float]) -> tuple[float, float]:
    """(α seconds, β seconds a byte) of the line `seconds = α + β · size` closest to the points.

    Least squares on relative errors (each point weighted 1 / its time), so the small messages,
    which set α, count as much as the large ones, which set β. A negative α (latency below what
    the points can resolve) is taken as 0, and β refitted.
    """
    sizes = numpy.asarray(sizes_bytes, dtype=float)
    times = numpy.asarray(seconds, dtype=float)
    if sizes.shape != times.shape or sizes.ndim != 1:
        raise ValueError(f'need one time a size, got {sizes.shape} sizes and {times.shape} times')
    if len(numpy.unique(sizes)) < 2 or (times <= 0).any():
        raise ValueError('fitting α and β needs at least two different sizes and positive '
                         f'times; got sizes {sizes.tolist()} and times {times.tolist()}')
    weights = 1 / times
    design = numpy.stack([numpy.ones_like(sizes), sizes], axis=1) * weights[:, None]
    (alpha, beta), *_ = numpy.linalg.lstsq(design, times * weights, rcond=None)
    if alpha < 0:
        alpha = 0.0
        beta = float(numpy.sum(sizes * weights ** 2 * times) / numpy.sum((sizes * weights) ** 2))
    return float(alpha), float(beta)
