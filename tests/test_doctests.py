"""The examples in docstrings run: a reader who copies one gets what the docstring shows.

Each module's examples see `d2l` (the package, as the chapters import it). Add a module here
when its docstrings gain examples. The distributed store has none: it needs an MPI job
(tests/mpi/test_kvstore_dist.py runs it).
"""
import doctest
import importlib

import pytest

import d2lperf as d2l

pytestmark = pytest.mark.chapter('parameter_servers')

MODULES_WITH_EXAMPLES = ['d2lperf.kvstore.base', 'd2lperf.kvstore.local',
                         'd2lperf.comm.allreduce', 'd2lperf.comm.flat_sum',
                         'd2lperf.nn.transformer', 'd2lperf.comm.all_to_all',
                         'd2lperf.nn.moe', 'd2lperf.model_parallel.expert', 'd2lperf.comm.send',
                         'd2lperf.model_parallel.context']


@pytest.mark.parametrize('name', MODULES_WITH_EXAMPLES)
def test_the_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs={'d2l': d2l})
    assert result.attempted > 0, f'{name} has no examples: take it off the list'
    assert result.failed == 0
