"""Data for the training chapters: Fashion-MNIST and a text corpus, downloaded once,
checked and cached.

Fashion-MNIST (Xiao et al., 2017) is fetched from its authors' mirror, each file checked
against its published MD5 sum and written to a cache atomically, so an interrupted download
never leaves a half file behind. Machines without internet fall back to a small real
dataset that scikit-learn ships (8×8 handwritten digits), and say so in one line (the reason
too under D2LPERF_VERBOSE=1).
`load_data_fashion_mnist` serves either as minibatches of d2lperf arrays, the digits resized
to 28×28 so that a network written for Fashion-MNIST runs on them unchanged.

The language model of "Model Parallelism" reads characters: tiny Shakespeare (Karpathy's
char-rnn corpus) where it can be had and verified, else CPython's own documentation, which
every Python ships (`pydoc_data`); `char_batches` cuts either into (input, next-character)
minibatches.

How well a net predicts the test set: `evaluate_accuracy_gpu` on one device, and
`evaluate_accuracy_gpus` with each batch split among every device the net lives on, as
"Training on Multiple GPUs" and the chapters after it train it.
"""
import gzip
import hashlib
import os
import pathlib
import urllib.error
import urllib.request

import numpy

from . import np
from .comm import split_batch
from .device import Device
from .utils import Accumulator, atomic_write

FASHION_MNIST_URL = 'http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/'
FASHION_MNIST_FILES = {
    'train_images': ('train-images-idx3-ubyte.gz', '8d4fb7e6c68d591d4c3dfef9ec88bf0d'),
    'train_labels': ('train-labels-idx1-ubyte.gz', '25c81989df183df01b3e8a0aad5dffbe'),
    'test_images': ('t10k-images-idx3-ubyte.gz', 'bef4ecab320f06d8554ea6380940ec79'),
    'test_labels': ('t10k-labels-idx1-ubyte.gz', 'bb300cfdad3c16e7a12a480ee83cd310'),
}
FASHION_MNIST_SIDE = 28
TIMEOUT_SECONDS = 5


def cache_dir():
    """Where downloads are kept: $D2LPERF_DATA, else ~/.cache/d2lperf."""
    return pathlib.Path(os.environ.get('D2LPERF_DATA', pathlib.Path.home() / '.cache' / 'd2lperf'))


def md5(data):
    return hashlib.md5(data).hexdigest()


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def fetch(name, checksum, base_url=FASHION_MNIST_URL, root=None, digest=md5):
    """The cached file `name`, downloaded first if it is missing or fails its checksum
    (`digest`: md5, as Fashion-MNIST publishes, or sha256)."""
    path = (root or cache_dir()) / name
    if path.exists() and digest(path.read_bytes()) == checksum:
        return path
    with urllib.request.urlopen(base_url + name, timeout=TIMEOUT_SECONDS) as response:
        data = response.read()
    if digest(data) != checksum:
        raise ValueError(f'{name} from {base_url} has {digest.__name__.upper()} {digest(data)}, '
                         f'expected {checksum}: the download is corrupt or the mirror changed; '
                         'nothing was cached, try again later')
    atomic_write(path, lambda file: file.write(data))
    return path


def read_idx(path):
    """Parse an IDX file (the MNIST format): big-endian dimensions, then unsigned bytes."""
    raw = gzip.decompress(pathlib.Path(path).read_bytes())
    if len(raw) < 4 or raw[:2] != b'\0\0' or raw[2] != 0x08:
        raise ValueError(f'{path} is not an IDX file of unsigned bytes')
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], 'big') for i in range(ndim))
    body = raw[4 + 4 * ndim:]
    if len(body) != int(numpy.prod(shape)):
        raise ValueError(f'{path}: header says {shape}, but the file holds {len(body)} bytes')
    return numpy.frombuffer(body, dtype=numpy.uint8).reshape(shape)


def fashion_mnist(root=None):
    """Fashion-MNIST as float32 images in [0, 1] of shape (N, 1, 28, 28) and int64 labels."""
    arrays = {key: read_idx(fetch(name, checksum, root=root))
              for key, (name, checksum) in FASHION_MNIST_FILES.items()}
    images = {k: (arrays[k][:, None] / numpy.float32(255)).astype(numpy.float32)
              for k in ('train_images', 'test_images')}
    return (images['train_images'], arrays['train_labels'].astype(numpy.int64),
            images['test_images'], arrays['test_labels'].astype(numpy.int64))


def digits(test_fraction=0.2, seed=0):
    """scikit-learn's 1797 handwritten digits (8×8), split the same way every time."""
    from sklearn.datasets import load_digits
    bunch = load_digits()
    images = (bunch.images[:, None] / 16).astype(numpy.float32)
    labels = bunch.target.astype(numpy.int64)
    order = numpy.random.default_rng(seed).permutation(len(labels))
    cut = int(len(labels) * (1 - test_fraction))
    train, test = order[:cut], order[cut:]
    return images[train], labels[train], images[test], labels[test]


class DataUnavailable(RuntimeError):
    """Neither the download nor its offline fallback could give the data."""


def download_or_fallback(root=None):
    """(name, arrays, why): Fashion-MNIST if it can be had, else the digits and the reason;
    where the digits cannot be had either (scikit-learn, an optional dependency, is not
    installed), one error that says what failed and what fixes it."""
    try:
        return 'Fashion-MNIST', fashion_mnist(root), None
    except (urllib.error.URLError, OSError) as err:
        try:
            return "scikit-learn's digits", digits(), err
        except ImportError as missing:
            raise DataUnavailable(
                f'Fashion-MNIST could not be downloaded ({type(err).__name__}: {err}), and the '
                "offline fallback, scikit-learn's handwritten digits, needs scikit-learn, "
                f'which is not installed ({missing}). Install it with `pip install '
                "scikit-learn` (or, in a clone of the book, `pip install -e '.[book]'`), or "
                'run where the download can reach '
                f'{FASHION_MNIST_URL} (the files are then cached in {root or cache_dir()})'
            ) from None


def interpolation_matrix(old, new):
    """(new, old) weights of linear interpolation along one axis of an image.

    Each new pixel's centre is mapped into the old pixel grid (centres aligned, as PIL and
    OpenCV do) and reads the two old pixels around it, weighted by closeness.
    """
    centres = numpy.clip((numpy.arange(new) + 0.5) * old / new - 0.5, 0, old - 1)
    low = numpy.floor(centres).astype(int)
    high = numpy.minimum(low + 1, old - 1)
    weights = numpy.zeros((new, old), numpy.float32)
    numpy.add.at(weights, (numpy.arange(new), low), 1 - (centres - low))
    numpy.add.at(weights, (numpy.arange(new), high), centres - low)
    return weights


def resize_images(images, size):
    """Bilinear resize of (N, C, H, W) images to (N, C, size, size): two matrix products.

    Each product is one large GEMM over the whole batch (rows of all images side by side),
    not one small product per image, which NumPy would run one by one.
    """
    n, c, h, w = images.shape
    wide = images.reshape(n * c * h, w) @ interpolation_matrix(w, size).T     # (n c h, size)
    wide = wide.reshape(n * c, h, size).transpose(1, 0, 2).reshape(h, n * c * size)
    tall = interpolation_matrix(h, size) @ wide                              # (size, n c size)
    return numpy.ascontiguousarray(
        tall.reshape(size, n, c, size).transpose(1, 2, 0, 3), dtype=numpy.float32)


def check_positive(what, value):
    if not isinstance(value, (int, numpy.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f'{what} must be a positive integer, not {value!r}')


class DataIterator:
    """Minibatches (X, y) of d2lperf arrays on the CPU; each `for` loop over it is one epoch.

    With `shuffle`, every epoch visits the examples in a new order, drawn from one generator
    seeded once, so a seed fixes the whole sequence of epochs. The last batch may be smaller.
    """

    def __init__(self, features, labels, batch_size, shuffle=False, seed=None, resize=None,
                 dataset_name=''):
        if len(features) != len(labels):
            raise ValueError(f'{len(features)} examples but {len(labels)} labels')
        check_positive('batch_size', batch_size)
        if resize is not None:
            check_positive('resize', resize)
        self.features, self.labels, self.batch_size = features, labels, int(batch_size)
        self.shuffle, self.resize, self.dataset_name = shuffle, resize, dataset_name
        self.generator = numpy.random.default_rng(seed)

    def __len__(self):
        return -(-len(self.labels) // self.batch_size)

    def __iter__(self):
        count = len(self.labels)
        order = self.generator.permutation(count) if self.shuffle else numpy.arange(count)
        for start in range(0, count, self.batch_size):
            batch = order[start:start + self.batch_size]
            images = self.features[batch]
            if self.resize:
                images = resize_images(images, self.resize)
            yield np.array(images), np.array(self.labels[batch])


def load_data_fashion_mnist(batch_size, resize=None, seed=None, max_train_examples=None,
                            max_test_examples=None, root=None):
    """(train_iter, test_iter) over Fashion-MNIST, or over the offline digits at 28×28.

    Training batches are shuffled each epoch (`seed` makes the order reproducible), test
    batches are not. The max_*_examples keep the first examples of each split, for short runs.
    It prints which dataset it serves, and each iterator names it in `.dataset_name`.
    """
    check_positive('batch_size', batch_size)
    for what, value in (('max_train_examples', max_train_examples),
                        ('max_test_examples', max_test_examples), ('resize', resize)):
        if value is not None:
            check_positive(what, value)
    name, (x_train, y_train, x_test, y_test), why = download_or_fallback(root)
    side = x_train.shape[-1]
    if side != FASHION_MNIST_SIDE:
        x_train = resize_images(x_train, FASHION_MNIST_SIDE)
        x_test = resize_images(x_test, FASHION_MNIST_SIDE)
    totals = len(y_train), len(y_test)
    x_train, y_train = x_train[:max_train_examples], y_train[:max_train_examples]
    x_test, y_test = x_test[:max_test_examples], y_test[:max_test_examples]
    print(describe(name, why, (len(y_train), len(y_test)), totals, side, resize))
    return (DataIterator(x_train, y_train, batch_size, True, seed, resize, name),
            DataIterator(x_test, y_test, batch_size, False, None, resize, name))


def describe(name, why, used, totals, side, resize):
    """One line that says which dataset a run trains on, and how much of it; where
    Fashion-MNIST was not reachable it says so, with the reason only under D2LPERF_VERBOSE=1."""
    shown = resize or FASHION_MNIST_SIDE
    sizes = (f'{used[0]:,} of {totals[0]:,} training and {used[1]:,} of {totals[1]:,} test '
             f'images, {side}x{side}' + (f' resized to {shown}x{shown}' if shown != side else ''))
    if why is None:
        return f'dataset: {name}, {sizes}'
    reason = f' ({why})' if os.environ.get('D2LPERF_VERBOSE') else ''
    return f'Fashion-MNIST is not reachable{reason}: training on {name} ({sizes})'


# -- a text corpus, read character by character ---------------------------------------------

TINY_SHAKESPEARE_URL = ('https://raw.githubusercontent.com/karpathy/char-rnn/master/data/'
                        'tinyshakespeare/')
# The SHA-256 of input.txt must be filled in from a trusted copy: the machine this was
# written on had no network, and a checksum computed from an unverified download would vouch
# for nothing. Until it is, `tiny_shakespeare` refuses to download and the corpus falls back.
TINY_SHAKESPEARE_FILE = ('input.txt', None)


class UnverifiedData(LookupError):
    """A dataset this package has no trusted checksum for: it is not downloaded."""


def tiny_shakespeare(root=None):
    """The 40,000 lines of Shakespeare of Karpathy's char-rnn, fetched, checked and cached."""
    name, checksum = TINY_SHAKESPEARE_FILE
    if checksum is None:
        raise UnverifiedData('no trusted SHA-256 for tiny Shakespeare is recorded in '
                             'd2lperf.data.TINY_SHAKESPEARE_FILE, so it is not downloaded')
    return fetch(name, checksum, TINY_SHAKESPEARE_URL, root, digest=sha256).read_text('utf-8')


def python_docs():
    """CPython's documentation topics (`pydoc_data`, about 465,000 characters), joined in
    the order of their names so the text is the same on every run."""
    from pydoc_data.topics import topics
    return '\n'.join(topics[name] for name in sorted(topics))


def load_text_corpus(root=None):
    """(text, corpus name): tiny Shakespeare if it can be had and verified, else CPython's
    documentation; prints which, in one line (the reason too under D2LPERF_VERBOSE=1)."""
    try:
        text, name, why = tiny_shakespeare(root), 'tiny Shakespeare', None
    except (urllib.error.URLError, OSError, UnverifiedData) as err:
        text, name, why = python_docs(), "CPython's documentation (pydoc_data)", err
    reason = f' ({why})' if why is not None and os.environ.get('D2LPERF_VERBOSE') else ''
    fallback = '' if why is None else f'tiny Shakespeare is not available{reason}: '
    print(f'{fallback}text corpus: {name}, {len(text):,} characters')
    return text, name


class CharVocabulary:
    """The distinct characters of a text, each with an id (in code-point order)."""

    def __init__(self, text):
        self.chars = sorted(set(text))
        self.ids = {c: i for i, c in enumerate(self.chars)}

    def __len__(self):
        return len(self.chars)

    def encode(self, text):
        return numpy.fromiter(map(self.ids.__getitem__, text), numpy.int64, len(text))

    def decode(self, ids):
        return ''.join(self.chars[i] for i in numpy.asarray(ids).ravel())


def char_batches(ids, batch_size, seq_len, num_batches, seed=None, device=None):
    """`num_batches` minibatches (X, Y) of d2lperf int64 arrays (batch_size, seq_len): X
    windows of the encoded text at random offsets, Y the same windows one character later
    (the next character to predict at every position)."""
    for what, value in (('batch_size', batch_size), ('seq_len', seq_len),
                        ('num_batches', num_batches)):
        check_positive(what, value)
    if len(ids) <= seq_len:
        raise ValueError(f'a text of {len(ids)} characters has no window of {seq_len} + 1')
    generator = numpy.random.default_rng(seed)
    window = numpy.arange(seq_len)
    for _ in range(num_batches):
        starts = generator.integers(0, len(ids) - seq_len, batch_size)[:, None]
        yield (np.array(ids[starts + window], device=device),
               np.array(ids[starts + window + 1], device=device))


# -- test accuracy --------------------------------------------------------------------------

def accuracy(y_hat, y):
    """How many predictions are right, as a float: `y_hat` holds scores or predicted classes."""
    if y_hat.ndim > 1 and y_hat.shape[1] > 1:
        y_hat = y_hat.argmax(axis=1)
    if y_hat.shape != y.shape:
        raise ValueError(f'{y_hat.shape[0] if y_hat.ndim else 1} predictions for labels of '
                         f'shape {y.shape}; pass the scores of the same batch')
    return float((y_hat.astype(y.dtype) == y).astype('float32').sum())


def evaluate_accuracy_gpu(net, data_iter, device=None):
    """The accuracy of `net` on `data_iter`, computed on one device.

    `device` defaults to the first device of the net's first parameter; a plain function
    (`lambda X: lenet(X, params)`) must name it.
    """
    if device is None:
        device = _devices_of(net, 'pass device=...')[0]
    if not isinstance(device, Device):
        raise TypeError(f'device must be a Device such as d2l.cpu(0), not {device!r}')
    metric = Accumulator(2)                     # correct predictions, examples
    for X, y in data_iter:
        X, y = _on(X, device), _on(y, device)
        metric.add(accuracy(net(X), y), y.size)
    return _fraction_right(metric)


def evaluate_accuracy_gpus(net, data_iter, split_f=split_batch):
    """The accuracy of `net` on `data_iter`, each batch split among the net's devices."""
    devices = _devices_of(net, 'use a Block (net.initialize(device=[...]))')
    metric = Accumulator(2)                     # correct predictions, examples
    for features, labels in data_iter:
        X_shards, y_shards = split_f(features, labels, devices)
        predictions = [net(X_shard) for X_shard in X_shards]      # all devices at once
        metric.add(sum(accuracy(y_hat, y_shard)
                       for y_hat, y_shard in zip(predictions, y_shards)), labels.size)
    return _fraction_right(metric)


def _devices_of(net, fix):
    """The devices of the net's first parameter: where the net was initialized."""
    params = list(net.collect_params().values()) if hasattr(net, 'collect_params') else []
    if not params:
        raise TypeError(f'{net!r} has no parameters to say which devices it runs on; {fix}')
    return params[0].list_device()


def _fraction_right(metric):
    if metric[1] == 0:
        raise ValueError('data_iter gave no examples to evaluate on')
    return metric[0] / metric[1]


def _on(array, device):
    return array if array.device is device else array.copyto(device)
