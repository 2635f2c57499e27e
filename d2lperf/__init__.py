"""d2lperf: the package behind "Computational Performance, a runnable course".

Its entries are the course's table of contents. They are listed here in the order the
chapters teach them (_toc.yml), after those that every chapter uses; a folder is a part of
several lessons, a module one lesson. Below the list, the same entries as layers, bottom
first: each imports only from itself and from the layers before it (tests/test_layering.py
checks the list and the layers against the tree and every import).

Every chapter
    utils         timers (one median-of-repeats loop for everything: `median_seconds`),
                  workload sizes, atomic file writes and the training-curve Animator.
    device/       where an array lives (cpu(i), gpu(i)), which array module computes there,
                  how data moves between two devices, the one way CuPy is imported
                  (devices.py); and the ledger of the bytes the arrays on each device hold,
                  by kind, with the peak (`memory`), with all that writes it (`Held`,
                  `label`, `release`: ledger.py).
    np/           the array: NDArray, a NumPy-like array whose every operation is one engine
                  push (multiarray.py, MXNet's name); what autograd records on each array
                  (tape.py); NumPy's names for its operations (np, np.random); and the
                  operators NumPy lacks: activations, convolution, pooling, batch norm
                  (extension.py, which is `npx`).
    autograd      reverse mode over the tape, with Gluon's record, pause, train and predict
                  modes.
    nn/           Gluon-style blocks, layers, losses, initializers and parameters, compiled by
                  hybrid, and the networks the training chapters build (LeNet, ResNet-18).
    data          Fashion-MNIST, downloaded, checked and cached, with an offline fallback.
Compilers and Interpreters
    hybrid/       the tracing compiler: trace, graph IR, passes, memory plan, generated code
                  (NumPy, or CuPy kernels on a GPU), export and import.
Asynchronous Computation, Automatic Parallelism
    engine/       the dependency engine: tracking (variables, operations, the rules that
                  order them, failures) apart from the policies that run them (threaded and
                  naive engines; workers: a thread per device and lane, CUDA streams, waiters
                  that help; blas: BLAS threads that fit the cores others leave free; pieces:
                  a large operation cut over the cores; freed_memory: freed memory kept for
                  the next step); and profiler/, the engine's records of what ran where and
                  when: a Chrome trace, a timeline, a summary, the dependency graph.
    ops/          every operation, by family, with its compute, shape, dtype and gradient
                  rules and what the compiler may do with it.
Hardware
    hardware/     microbenchmarks of the reader's machine: what is in the box, memory,
                  arithmetic, storage and network, the GPU; imported on demand.
Training on Multiple GPUs, Concise Implementation for Multiple GPUs
    comm/         a minibatch split among devices; allreduce across them by six algorithms
                  (schedules run as engine operations), its two halves (reduce-scatter,
                  all-gather), gradients summed through flat buffers made once, the
                  all-to-all and a point-to-point send, and what each costs on a topology.
    data_parallel/  every way the book sums gradients: by hand (from_scratch), the Trainer
                  through a key-value store of any type, overlap with backward, test accuracy
                  on one device or split among several (evaluation), and, "Data Parallelism
                  at Scale", buckets, ZeRO's stages 1-3 and the calculator that predicts what
                  a step holds and moves.
    model_parallel/  the model itself split over devices: pipeline schedules as data (GPipe,
                  1F1B, interleaved), their bubble and the activations a stage holds;
                  Megatron-LM's tensor and sequence parallelism; the three parallelisms at
                  once on a grid of devices (layout), and the calculator that predicts what
                  each device of a layout holds and sends (predict); context parallelism
                  (the ring, the all-gather, Ulysses) and expert parallelism.
Parameter Servers
    optimizer/    the update rules (SGD with momentum and weight decay, Adam) that a trainer
                  or a key-value store applies, with their states as plain arrays (rules.py),
                  the from-scratch chapter's SGD on a list of arrays (by_hand.py), float32
                  master weights for float16 and bfloat16 ones (`multi_precision`),
                  and, "Memory", the dynamic loss scaler that float16 gradients need (amp.py,
                  which is `d2l.amp`, with MXNet AMP's names).
    kvstore/      the (key, value) store (also "Distributed Training"): the in-process stores
                  (local, device); the distributed store's worker side, its server and the
                  wire protocol between them (over MPI, never pickled).
Distributed Training
    launch        python -m d2lperf.launch: a job under mpiexec, here, on a hostfile or over
                  ssh; a failed rank is named and ends the job. It imports nothing of the
                  package, so that it runs before d2lperf's dependencies are installed.
    train_mnist   python -m d2lperf.train_mnist: LeNet or an MLP with any store, one line
                  an epoch.
Inference
    inference/    generation, prefill then one token a step, with each layer's keys and
                  values kept in a KV cache, contiguous or in pages of a pool (vLLM's
                  PagedAttention) with a block table a sequence.

Layers, bottom first:
    utils < device < engine < ops < np < autograd < hybrid < nn < comm < optimizer < kvstore
    < data_parallel < model_parallel < data < hardware < inference < launch < train_mnist
"""
from . import engine      # first: it sets OpenBLAS's spin before NumPy loads (engine/blas.py)
from .device import Device, cpu, gpu, num_gpus, try_all_gpus, try_devices, try_gpu
from . import np, autograd, nn
from .np import extension as npx
from .nn import L2Loss, SoftmaxCrossEntropyLoss
from .data_parallel import Trainer, get_params
from .optimizer.by_hand import sgd
from .utils import (Accumulator, Animator, Benchmark, Timer, median_seconds, process_memory,
                    quick_mode, workload)
from . import comm, data, data_parallel, hybrid, inference, kvstore, model_parallel, optimizer
from .optimizer import amp
from .engine import profiler
from .comm import split_and_load, split_batch
# d2l.allreduce is the from-scratch chapter's "everything to the first device" (the name the
# MXNet edition gives it); d2l.comm.allreduce runs the six algorithms of "Parameter Servers".
from .comm import allreduce_on_first as allreduce
from .data_parallel import accuracy, evaluate_accuracy_gpu, evaluate_accuracy_gpus
from .data import load_data_fashion_mnist
from .nn import Residual, lenet, resnet18

__all__ = ['engine', 'Device', 'cpu', 'gpu', 'num_gpus', 'try_all_gpus', 'try_devices',
           'try_gpu', 'np', 'npx', 'autograd', 'nn', 'L2Loss', 'SoftmaxCrossEntropyLoss',
           'Trainer', 'get_params', 'sgd', 'Accumulator', 'Animator', 'Benchmark', 'Timer',
           'median_seconds', 'process_memory', 'quick_mode', 'workload', 'comm', 'data',
           'data_parallel', 'hybrid', 'inference', 'kvstore', 'model_parallel', 'optimizer', 'amp',
           'profiler', 'allreduce', 'split_and_load', 'split_batch', 'accuracy', 'evaluate_accuracy_gpu',
           'evaluate_accuracy_gpus', 'load_data_fashion_mnist', 'Residual', 'lenet', 'resnet18']
