"""d2lperf: the package behind "Computational Performance, a runnable course".

The layers import downward only: device → engine → ops → ndarray → autograd → hybrid → nn
→ comm → optimizer → kvstore → trainer, and each module below imports only modules listed
above it. The trainer sums gradients over devices through a key-value store, which runs comm's
algorithms. Only NDArray's attach_grad and backward reach up: they import autograd when
called.

    utils         timers (one median-of-repeats loop for everything), workload sizes, atomic
                  file writes and the training-curve Animator; it imports nothing of the package.
    device        where an array lives (cpu(i), gpu(i)), which array module computes there,
                  and how data moves between two of them.
    blas          the BLAS thread count that virtual CPU devices share, divided among the
                  busy ones on request.
    host_memory   freed host memory kept for the next step instead of returned to the OS
                  (glibc's mallopt), so a training loop does not page-fault every step.
    workers       the engine's running policy: a thread per device and lane, which device
                  a thread runs, CUDA streams and the events between them.
    engine        the dependency engine: operations run in the order of the variables they
                  read and write, and a failure waits on what it should have written.
    ops           every operation, by family, with its compute, shape, dtype and gradient
                  rules and what the compiler may do with it.
    tape          what autograd records on each array, and the recording and training flags.
    ndarray       NDArray, a NumPy-like array whose every operation is one engine push;
                  np gives it NumPy's names, npx the operators NumPy lacks.
    autograd      reverse mode over the tape, with Gluon's record, pause, train and predict
                  modes.
    hybrid        the tracing compiler: trace, graph IR, passes, memory plan, generated code,
                  export and import.
    nn            Gluon-style blocks, layers, losses, initializers and parameters, compiled by
                  hybrid.
    comm          a minibatch split among devices; allreduce across them by six algorithms
                  (schedules run as engine operations), and what each costs on a topology.
    optimizer     the update rules (SGD with momentum and weight decay) that a trainer or a
                  key-value store applies, with their states as plain arrays.
    kvstore       the (key, value) store: push values, pull results; where the sums and
                  updates happen ('local', 'device'), and the way to the distributed stores.
    trainer       minibatch SGD over a net's parameters on every device, its gradients
                  summed through a key-value store of any type (updated there, if it is
                  distributed).

Beside the layers, imported by none of them:

    models        LeNet, the residual block and ResNet-18, as the training chapters use them.
    training      SGD, accuracy and evaluation written from scratch, for the chapters that
                  build multi-device training by hand.
    profiler      the engine's records of what ran where and when, as a Chrome trace, a
                  timeline and a summary.
    depgraph      the dependency graph those records imply, drawn.
    data          Fashion-MNIST, downloaded, checked and cached, with an offline fallback.
    hardware      microbenchmarks of the reader's machine (hardware_gpu: its GPU,
                  hardware_io: cores, storage and network), imported on demand.
    transport     messages between parameter-server processes: an int64 header and the
                  array's raw bytes over MPI, never pickled; forged headers refused.
    kvstore_server  the server's loop: a slice of every key, sync rounds or async updates,
                  the optimizer run where the weights live.
    kvstore_dist  the distributed store (dist_sync, dist_device_sync, dist_async): roles by
                  MPI rank, workers push and pull, servers update; needs mpi4py, and
                  kvstore imports it only when one is created.
    launch        python -m d2lperf.launch: a job under mpiexec, here, on a hostfile or over
                  ssh; a failed rank is named and ends the job.
    train_mnist   python -m d2lperf.train_mnist: LeNet or an MLP trained by the Trainer with
                  any store, one line an epoch.
"""
from . import engine
from .device import Device, cpu, gpu, num_gpus, try_all_gpus, try_devices, try_gpu
from . import np, npx, autograd, nn
from .nn import L2Loss, SoftmaxCrossEntropyLoss
from .trainer import Trainer
from .utils import Accumulator, Animator, Benchmark, Timer, memory_in_use, quick_mode, workload
from . import comm, data, hybrid, kvstore, optimizer, profiler
from .comm import split_and_load, split_batch
from .comm import allreduce_on_first as allreduce        # the source's, "Multiple GPUs"
from .evaluation import accuracy, evaluate_accuracy_gpu, evaluate_accuracy_gpus
from .from_scratch import get_params, sgd
from .data import load_data_fashion_mnist
from .nn import Residual, lenet, resnet18

__all__ = ['engine', 'Device', 'cpu', 'gpu', 'num_gpus', 'try_all_gpus', 'try_devices', 'try_gpu', 'np', 'npx',
           'autograd', 'nn', 'L2Loss', 'SoftmaxCrossEntropyLoss', 'Trainer', 'Accumulator',
           'Animator', 'Benchmark', 'Timer', 'memory_in_use', 'quick_mode', 'workload', 'comm',
           'data', 'hybrid', 'kvstore', 'optimizer', 'profiler', 'allreduce', 'split_and_load', 'split_batch', 'accuracy',
           'evaluate_accuracy_gpu', 'evaluate_accuracy_gpus', 'get_params', 'sgd',
           'load_data_fashion_mnist', 'Residual', 'lenet', 'resnet18']
