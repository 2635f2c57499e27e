"""Data for the training chapters: Fashion-MNIST, downloaded once, checked and cached.

Fashion-MNIST (Xiao et al., 2017) is fetched from its authors' mirror, each file checked
against its published MD5 sum and written to a cache atomically, so an interrupted download
never leaves a half file behind. Machines without internet fall back to a small real
dataset that scikit-learn ships (8×8 handwritten digits), and say so.
"""
import gzip
import hashlib
import os
import pathlib
import urllib.error
import urllib.request

import numpy

from .utils import atomic_write

FASHION_MNIST_URL = 'http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/'
FASHION_MNIST_FILES = {
    'train_images': ('train-images-idx3-ubyte.gz', '8d4fb7e6c68d591d4c3dfef9ec88bf0d'),
    'train_labels': ('train-labels-idx1-ubyte.gz', '25c81989df183df01b3e8a0aad5dffbe'),
    'test_images': ('t10k-images-idx3-ubyte.gz', 'bef4ecab320f06d8554ea6380940ec79'),
    'test_labels': ('t10k-labels-idx1-ubyte.gz', 'bb300cfdad3c16e7a12a480ee83cd310'),
}
FASHION_MNIST_CLASSES = ['t-shirt', 'trouser', 'pullover', 'dress', 'coat', 'sandal', 'shirt',
                         'sneaker', 'bag', 'ankle boot']
TIMEOUT_SECONDS = 5


def cache_dir():
    """Where downloads are kept: $D2LPERF_DATA, else ~/.cache/d2lperf."""
    return pathlib.Path(os.environ.get('D2LPERF_DATA', pathlib.Path.home() / '.cache' / 'd2lperf'))


def md5(data):
    return hashlib.md5(data).hexdigest()


def fetch(name, checksum, base_url=FASHION_MNIST_URL, root=None):
    """The cached file `name`, downloaded first if it is missing or fails its checksum."""
    path = (root or cache_dir()) / name
    if path.exists() and md5(path.read_bytes()) == checksum:
        return path
    with urllib.request.urlopen(base_url + name, timeout=TIMEOUT_SECONDS) as response:
        data = response.read()
    if md5(data) != checksum:
        raise ValueError(f'{name} from {base_url} has MD5 {md5(data)}, expected {checksum}: '
                         'the download is corrupt or the mirror changed; nothing was cached, '
                         'try again later')
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


def load_classification_data(root=None):
    """Fashion-MNIST if it can be had, else the digits; returns (name, arrays) and says which."""
    try:
        name, arrays = 'Fashion-MNIST', fashion_mnist(root)
    except (urllib.error.URLError, OSError) as err:
        name, arrays = 'scikit-learn digits (offline fallback)', digits()
        print(f'Fashion-MNIST could not be downloaded ({err}); using {name}')
    print(f'dataset: {name}, {len(arrays[0])} training and {len(arrays[2])} test images '
          f'of {arrays[0].shape[2]}x{arrays[0].shape[3]}')
    return name, arrays
