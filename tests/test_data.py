"""Data loading: checksums, atomic cache writes, the IDX format and the offline fallback."""
import gzip
import sys
import urllib.error

import numpy
import pytest

from d2lperf import data


def idx_bytes(array):
    header = bytes([0, 0, 0x08, array.ndim]) + b''.join(n.to_bytes(4, 'big') for n in array.shape)
    return gzip.compress(header + array.astype(numpy.uint8).tobytes())


class FakeResponse:
    def __init__(self, payload):
        self.payload = payload

    def read(self):
        return self.payload

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_read_idx_round_trips(tmp_path):
    array = numpy.arange(2 * 3 * 4).reshape(2, 3, 4) % 256
    (tmp_path / 'a.gz').write_bytes(idx_bytes(array))
    numpy.testing.assert_array_equal(data.read_idx(tmp_path / 'a.gz'), array)


def test_read_idx_rejects_a_truncated_file(tmp_path):
    payload = gzip.decompress(idx_bytes(numpy.zeros((4, 4))))[:-3]
    (tmp_path / 'bad.gz').write_bytes(gzip.compress(payload))
    with pytest.raises(ValueError, match='header says'):
        data.read_idx(tmp_path / 'bad.gz')


def test_fetch_checks_and_caches(tmp_path, monkeypatch):
    payload = idx_bytes(numpy.ones((2, 2)))
    calls = []
    monkeypatch.setattr(data.urllib.request, 'urlopen',
                        lambda url, timeout: calls.append(url) or FakeResponse(payload))
    path = data.fetch('x.gz', data.md5(payload), base_url='http://mirror/', root=tmp_path)
    assert path.read_bytes() == payload and calls == ['http://mirror/x.gz']
    data.fetch('x.gz', data.md5(payload), base_url='http://mirror/', root=tmp_path)
    assert len(calls) == 1                                  # second time from the cache
    assert [p.name for p in tmp_path.iterdir()] == ['x.gz']  # no temporary left behind


def test_fetch_refuses_a_corrupt_download_and_caches_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(data.urllib.request, 'urlopen', lambda url, timeout: FakeResponse(b'junk'))
    with pytest.raises(ValueError, match='MD5'):
        data.fetch('x.gz', '0' * 32, root=tmp_path)
    assert not (tmp_path / 'x.gz').exists()


def test_offline_falls_back_to_digits(tmp_path, monkeypatch):
    def offline(url, timeout):
        raise urllib.error.URLError('no network')
    monkeypatch.setattr(data.urllib.request, 'urlopen', offline)
    name, (x_train, y_train, x_test, y_test), why = data.download_or_fallback(root=tmp_path)
    assert 'digits' in name and 'no network' in str(why)
    assert x_train.shape[1:] == (1, 8, 8) and x_train.dtype == numpy.float32
    assert len(x_train) + len(x_test) == 1797
    assert 0 <= x_train.min() and x_train.max() <= 1
    assert set(numpy.unique(y_train)) == set(range(10))


@pytest.mark.parametrize('verbose', [False, True])
def test_the_fallback_is_one_line_with_the_reason_only_when_verbose(offline, monkeypatch,
                                                                     capsys, verbose):
    if verbose:
        monkeypatch.setenv('D2LPERF_VERBOSE', '1')
    else:
        monkeypatch.delenv('D2LPERF_VERBOSE', raising=False)
    data.load_data_fashion_mnist(64, max_train_examples=100)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith('Fashion-MNIST is not reachable')
    assert "training on scikit-learn's digits (100 of 1,437 training" in lines[0]
    assert ('no network' in lines[0]) == verbose


# -- minibatches for the training chapters --------------------------------------------------------

@pytest.fixture
def offline(monkeypatch):
    def refuse(url, timeout):
        raise urllib.error.URLError('no network')
    monkeypatch.setattr(data.urllib.request, 'urlopen', refuse)


def fake_fashion_mnist(root=None):
    rng = numpy.random.default_rng(0)
    images = lambda n: rng.uniform(0, 1, (n, 1, 28, 28)).astype(numpy.float32)  # noqa: E731
    return images(50), numpy.arange(50) % 10, images(20), numpy.arange(20) % 10


def first_batches(iterator):
    return [(X.asnumpy(), y.asnumpy()) for X, y in iterator]


def test_offline_loader_serves_digits_at_28x28(offline, tmp_path, capsys):
    train_iter, test_iter = data.load_data_fashion_mnist(256, root=tmp_path)
    assert 'digits' in train_iter.dataset_name and 'digits' in test_iter.dataset_name
    assert '1,437 of 1,437 training' in capsys.readouterr().out
    assert (len(train_iter), len(test_iter)) == (6, 2)             # 1437 / 256, 360 / 256
    batches = first_batches(train_iter)
    X, y = batches[0]
    assert X.shape == (256, 1, 28, 28) and X.dtype == numpy.float32
    assert y.shape == (256,) and y.dtype.kind == 'i'
    assert 0 <= X.min() and X.max() <= 1
    assert sum(len(y) for _, y in batches) == 1437 and len(batches[-1][1]) == 1437 - 5 * 256


def test_loader_serves_fashion_mnist_when_it_can(monkeypatch, capsys):
    monkeypatch.setattr(data, 'fashion_mnist', fake_fashion_mnist)
    train_iter, test_iter = data.load_data_fashion_mnist(16, max_test_examples=8)
    assert train_iter.dataset_name == 'Fashion-MNIST'
    assert 'Fashion-MNIST, 50 of 50 training and 8 of 20 test images, 28x28\n' in \
        capsys.readouterr().out
    test_X = numpy.concatenate([X for X, _ in first_batches(test_iter)])
    numpy.testing.assert_array_equal(test_X, fake_fashion_mnist()[2][:8])     # not shuffled


def test_each_epoch_is_a_new_order_that_a_seed_repeats(monkeypatch):
    monkeypatch.setattr(data, 'fashion_mnist', fake_fashion_mnist)
    labels_of = lambda it: numpy.concatenate([y for _, y in first_batches(it)])  # noqa: E731
    train_iter, _ = data.load_data_fashion_mnist(16, seed=3)
    again, _ = data.load_data_fashion_mnist(16, seed=3)
    epochs = [labels_of(train_iter), labels_of(train_iter)]
    assert not numpy.array_equal(*epochs)                           # reshuffled
    assert sorted(epochs[0]) == sorted(numpy.arange(50) % 10)       # every example once
    numpy.testing.assert_array_equal(labels_of(again), epochs[0])   # the seed repeats it
    numpy.testing.assert_array_equal(labels_of(again), epochs[1])


def test_loader_caps_examples_and_resizes(offline, tmp_path, capsys):
    train_iter, test_iter = data.load_data_fashion_mnist(
        10, resize=32, max_train_examples=25, max_test_examples=12, root=tmp_path)
    assert 'resized to 32x32' in capsys.readouterr().out
    assert [len(y) for _, y in first_batches(train_iter)] == [10, 10, 5]
    assert [X.shape for X, _ in first_batches(test_iter)] == [(10, 1, 32, 32), (2, 1, 32, 32)]


@pytest.mark.parametrize('arguments, message', [
    ({'batch_size': 0}, 'batch_size must be a positive integer, not 0'),
    ({'batch_size': 4, 'resize': 2.5}, 'resize must be a positive integer'),
    ({'batch_size': 4, 'max_train_examples': -1}, 'max_train_examples must be'),
])
def test_loader_refuses_bad_sizes(arguments, message):
    with pytest.raises(ValueError, match=message):
        data.load_data_fashion_mnist(**arguments)


def test_batches_are_copies_of_the_dataset():
    features = numpy.zeros((4, 1, 2, 2), numpy.float32)
    (X, _), = data.DataIterator(features, numpy.arange(4), 4)
    X += 1
    assert features.sum() == 0


def test_resize_keeps_constants_and_interpolates_linearly():
    constant = numpy.full((2, 1, 8, 8), 0.25, numpy.float32)
    numpy.testing.assert_allclose(data.resize_images(constant, 28), 0.25, rtol=1e-6)
    ramp = numpy.arange(4, dtype=numpy.float32)[None, None, None, :].repeat(4, axis=2)
    same = data.resize_images(ramp, 4)
    numpy.testing.assert_allclose(same, ramp, atol=1e-6)                      # identity
    doubled = data.resize_images(ramp, 8)[0, 0, 0]
    numpy.testing.assert_allclose(doubled, [0, 0.25, 0.75, 1.25, 1.75, 2.25, 2.75, 3], atol=1e-6)
    assert numpy.allclose(data.interpolation_matrix(8, 28).sum(axis=1), 1)


def test_resize_of_a_batch_equals_resizing_each_image():
    images = numpy.random.default_rng(0).uniform(0, 1, (3, 2, 8, 5)).astype(numpy.float32)
    rows, columns = data.interpolation_matrix(8, 7), data.interpolation_matrix(5, 7)
    numpy.testing.assert_allclose(data.resize_images(images, 7), rows @ images @ columns.T,
                                  rtol=1e-5, atol=1e-6)


@pytest.fixture
def no_sklearn(monkeypatch):
    """scikit-learn as if it were not installed: importing it raises ImportError."""
    for name in ('sklearn', 'sklearn.datasets'):
        monkeypatch.setitem(sys.modules, name, None)


def test_offline_without_scikit_learn_says_what_failed_and_what_fixes_it(offline, no_sklearn,
                                                                         tmp_path):
    """A bare ModuleNotFoundError named neither the download nor the fix."""
    with pytest.raises(data.DataUnavailable) as raised:
        data.load_data_fashion_mnist(64, root=tmp_path)
    message = str(raised.value)
    for words in ('Fashion-MNIST could not be downloaded (URLError', 'no network',
                  "scikit-learn's handwritten digits, needs scikit-learn",
                  '`pip install scikit-learn`', "`pip install -e '.[book]'`", str(tmp_path)):
        assert words in message
