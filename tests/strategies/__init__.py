"""Hypothesis strategies for the tests, one module a family:

    ops        inputs and attributes for every operation
    programs   instruction lists run by the engine and by NumPy
    nets       random networks and programs for the compiler (hybridized against imperative)
    comm       batches to split, arrays to allreduce over devices, attention split over them
"""
from hypothesis import HealthCheck, settings


def checks(max_examples):
    """Settings for a property test: few examples (the suite runs on 2 cores), no deadline
    (the engine's threads make timings noisy), and fixtures that switch engines allowed."""
    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
