"""Data loading: checksums, atomic cache writes, the IDX format and the offline fallback."""
import gzip
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


def test_offline_falls_back_to_digits(tmp_path, monkeypatch, capsys):
    def offline(url, timeout):
        raise urllib.error.URLError('no network')
    monkeypatch.setattr(data.urllib.request, 'urlopen', offline)
    name, (x_train, y_train, x_test, y_test) = data.load_classification_data(root=tmp_path)
    assert 'digits' in name and 'digits' in capsys.readouterr().out
    assert x_train.shape[1:] == (1, 8, 8) and x_train.dtype == numpy.float32
    assert len(x_train) + len(x_test) == 1797
    assert 0 <= x_train.min() and x_train.max() <= 1
    assert set(numpy.unique(y_train)) == set(range(10))
