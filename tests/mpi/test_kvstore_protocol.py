"""The wire format of the distributed store: numbers only, and forged messages refused."""
import numpy
import pytest

from tests.dist_helpers import run_program
from d2lperf.kvstore import protocol

pytestmark = pytest.mark.chapter('parameter_servers', 'distributed_training')

FORGER = '''
import numpy
from mpi4py import MPI
from d2lperf.kvstore import protocol

comm = MPI.COMM_WORLD

def forged(words, payload):
    header = numpy.zeros(protocol.HEADER_WORDS, numpy.int64)
    header[:len(words)] = words
    comm.Send(header, dest=0, tag=protocol.HEADER_TAG)
    comm.Send(payload, dest=0, tag=protocol.PAYLOAD_TAG)

if comm.rank == 1:
    push = protocol.CODE['push']
    forged([push, 7, 9, 1, 4] + [0] * 7 + [16], numpy.zeros(16, numpy.uint8))    # bad dtype
    forged([push, 7, 0, 1, -4] + [0] * 7 + [16], numpy.zeros(16, numpy.uint8))   # shape
    forged([push, 7, 0, 12, 4] + [0] * 7 + [16], numpy.zeros(16, numpy.uint8))   # ndim
    forged([push, 7, 0, 1, 4] + [0] * 7 + [16], numpy.zeros(8, numpy.uint8))    # truncated
    forged([99, 7, 0, 1, 4] + [0] * 7 + [16], numpy.zeros(16, numpy.uint8))     # command
    comm.Send(numpy.zeros(3, numpy.int64), dest=0, tag=protocol.HEADER_TAG)     # short header
    comm.Send(numpy.zeros(0, numpy.uint8), dest=0, tag=protocol.PAYLOAD_TAG)
    requests, buffers = protocol.send(comm, 0, 'push', 7, numpy.arange(4, dtype=numpy.float32))
    MPI.Request.Waitall(requests)
else:
    for _ in range(6):
        try:
            protocol.receive(comm, MPI.ANY_SOURCE)
            print('ACCEPTED')
        except protocol.ProtocolError as error:
            print('REFUSED', error)
    command, key, array, sender = protocol.receive(comm, MPI.ANY_SOURCE)
    print('VALID', command, key, array.tolist(), sender)
'''


def test_forged_messages_are_refused_naming_the_sender(tmp_path):
    result = run_program(tmp_path, FORGER, 2, timeout=60)
    assert result.returncode == 0, result.report()
    lines = result.stdout[0].splitlines()
    refused = [line for line in lines if line.startswith('REFUSED')]
    assert len(refused) == 6 and 'ACCEPTED' not in result.stdout[0]
    assert all('rank 1 sent' in line for line in refused)
    assert 'dtype code 9' in refused[0] and 'impossible shape' in refused[1]
    assert '12 dims' in refused[2] and '8 payload bytes' in refused[3]
    assert 'unknown command 99' in refused[4] and 'header of 24 bytes' in refused[5]
    assert 'VALID push 7 [0.0, 1.0, 2.0, 3.0] 1' in lines      # the channel stayed in step


def test_key_ids_are_stable_and_tell_types_apart():
    assert protocol.key_id(3) == protocol.key_id(3) != protocol.key_id('3')
    assert 0 <= protocol.key_id('weight') < 2 ** 56
    with pytest.raises(TypeError, match='int or a str'):
        protocol.key_id(1.5)


def test_headers_round_trip_through_the_parser():
    array = numpy.ones((2, 3, 4), numpy.int32)
    header = protocol.header_for('pull', 11, array)
    assert protocol.parse_header(header.view(numpy.uint8), 0) == (
        'pull', 11, numpy.dtype('int32'), (2, 3, 4), 96)
    with pytest.raises(ValueError, match='float32'):
        protocol.header_for('push', 1, numpy.ones(2, numpy.complex64))
