"""Train LeNet or an MLP on Fashion-MNIST with a chosen key-value store, as MXNet's example did.

    python -m d2lperf.train_mnist --network lenet --devices cpu0,cpu1 --kv-store device
    python -m d2lperf.launch -n 2 python -m d2lperf.train_mnist --kv-store dist_sync

Training goes through `Trainer`, whatever the store. With a dist_* store every worker reads
the same global batches of batch · num_workers examples and trains on its own slice of each,
pushes its gradients and pulls the weights the servers updated, so dist_sync takes the steps
of one process at the combined batch. With local or device the gradients are summed over this
process's devices. Each epoch prints one line: test accuracy, images per second, and what
ran. Taught in "Parameter Servers".
"""
import argparse
import sys

from . import autograd, comm, data, engine, kvstore, nn, np
from .np import extension as npx
from .device import cpu, gpu, slow_down
from .nn import lenet
from .data_parallel import Trainer
from .data import evaluate_accuracy_gpus
from .utils import Timer


def parse(argv):
    parser = argparse.ArgumentParser(prog='python -m d2lperf.train_mnist',
                                     description=__doc__.splitlines()[0])
    parser.add_argument('--network', choices=('lenet', 'mlp'), default='lenet')
    where = parser.add_mutually_exclusive_group()
    where.add_argument('--devices', default='cpu0', help='e.g. cpu0,cpu1')
    where.add_argument('--gpus', help='e.g. 0,2')
    parser.add_argument('--kv-store', choices=kvstore.TYPES, default='device')
    parser.add_argument('--batch-size', type=int, default=64)
    parser.add_argument('--lr', type=float, default=0.1)
    parser.add_argument('--epochs', type=int, default=2)
    parser.add_argument('--work-load-list', help='relative shares of the devices, e.g. 3,1')
    parser.add_argument('--max-examples', type=int, help='train on the first N examples only')
    parser.add_argument('--slow-down', metavar='DEVICE=FACTOR',
                        help='run a virtual CPU device FACTOR times slower, to stand for an '
                             'unequal pair of devices, e.g. cpu1=3')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args(argv)
    args.devices = devices_from(parser, args)
    if args.work_load_list:
        args.work_load_list = [float(share) for share in args.work_load_list.split(',')]
        if len(args.work_load_list) != len(args.devices):
            parser.error(f'--work-load-list gives {len(args.work_load_list)} shares for '
                         f'{len(args.devices)} devices')
    if args.slow_down:
        args.slow_down = slowdown_from(parser, args.slow_down, args.devices)
    for name in ('batch_size', 'epochs', 'max_examples'):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f'--{name.replace("_", "-")} must be 1 or more')
    return args


def devices_from(parser, args):
    try:
        if args.gpus:
            return [gpu(int(i)) for i in args.gpus.split(',')]
        names = args.devices.split(',')
        if not all(name.startswith('cpu') and name[3:].isdigit() for name in names):
            raise ValueError(f'--devices takes cpu0,cpu1,..., not {args.devices!r}')
        return [cpu(int(name[3:])) for name in names]
    except ValueError as error:
        parser.error(str(error))


def slowdown_from(parser, text, devices):
    """(device, factor) of a --slow-down value such as cpu1=3."""
    name, _, factor = text.partition('=')
    chosen = [device for device in devices if f'{device.kind}{device.index}' == name]
    try:
        factor = float(factor)
    except ValueError:
        parser.error(f'--slow-down takes DEVICE=FACTOR, e.g. cpu1=3, not {text!r}')
    if not chosen:
        parser.error(f'--slow-down names {name!r}, which is not among --devices')
    if chosen[0].kind != 'cpu' or not factor >= 1:
        parser.error(f'--slow-down slows a virtual CPU device by a factor of 1 or more, not '
                     f'{text!r}')
    return chosen[0], factor


def build_net(network):
    """The LeNet of "Training on Multiple GPUs" (ReLU, average pooling), or an MLP."""
    if network == 'lenet':
        return lenet()
    net = nn.HybridSequential()
    net.add(nn.Dense(256, activation='relu'), nn.Dense(128, activation='relu'), nn.Dense(10))
    return net


def my_part(features, labels, rank, num_workers):
    """This worker's rows of a global batch, or None if the batch is too small to share.

    Every worker reads the same global batches (one seed, num_workers times the batch size)
    and takes its own slice, so that together the workers see, step by step, exactly what one
    process at the whole batch would: dist_sync with n workers at batch b trains like one
    process at batch n·b, up to rounding.
    """
    if len(labels) < num_workers:
        return None
    sizes = comm.slice_sizes(len(labels), num_workers, even_split=False)
    begin = sum(sizes[:rank])
    return features[begin:begin + sizes[rank]], labels[begin:begin + sizes[rank]]


def train(args):
    store = kvstore.create(args.kv_store)   # a server process serves here and never returns
    if args.slow_down:
        slow_down(*args.slow_down)
    np.random.seed(args.seed)
    rank, num_workers = store.rank, store.num_workers
    train_iter, test_iter = data.load_data_fashion_mnist(
        args.batch_size * num_workers, seed=args.seed, max_train_examples=args.max_examples,
        max_test_examples=args.max_examples)
    net = build_net(args.network)
    net.initialize(init=nn.init.Xavier(), device=args.devices)
    net(np.array(train_iter.features[:1], device=args.devices[0]))     # infer the shapes
    net.hybridize()
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': args.lr}, kvstore=store)
    loss = nn.SoftmaxCrossEntropyLoss()
    for epoch in range(args.epochs):
        timer, seen = Timer(), 0
        for batch in train_iter:
            part = my_part(*batch, rank, num_workers)
            if part is None:
                continue
            X_shards, y_shards = (comm.split_and_load(a, args.devices, even_split=False,
                                                      work_load_list=args.work_load_list)
                                  for a in part)
            with autograd.record():
                losses = [loss(net(X), y) for X, y in zip(X_shards, y_shards)]
            for shard_loss in losses:
                shard_loss.backward()
            trainer.step(args.batch_size * num_workers)     # the examples summed
            seen += len(part[1])
        npx.waitall()
        seconds = timer.stop()
        accuracy = evaluate_accuracy_gpus(net, test_iter)
        print(f'epoch {epoch + 1}: test acc {accuracy:.3f}, {seen / seconds:.0f} images/s on '
              f'{",".join(str(d) for d in args.devices)}{slowed(args)}, '
              f'kvstore {store.type}, {train_iter.dataset_name}, {seen} examples, '
              f'worker {rank} of {num_workers}', flush=True)
    changes = engine.blas_thread_changes()
    if changes:     # then another run of the same job may differ in the last bits
        print(f'BLAS thread count changed {changes} times to fit the cores other programs '
              'left free', flush=True)
    return accuracy


def slowed(args):
    if not args.slow_down:
        return ''
    device, factor = args.slow_down
    return f' ({device} slowed {factor:g}×)'


def main(argv=None):
    """Train; where no data can be had, say why and how to fix it, without a traceback."""
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        train(args)
    except data.DataUnavailable as err:
        sys.exit(f'train_mnist: {err}')


if __name__ == '__main__':
    main()
