"""SGD's and Adam's updates as one CUDA kernel a parameter, on a GPU.

Written as CuPy array operations, Adam is a dozen kernels a parameter: each reads and writes
whole arrays in device memory and costs a launch from Python, and half of them allocate a
temporary. As one elementwise kernel it reads the gradient, the weight and its states once and
writes them once, as MXNet's `adam_update` and PyTorch's fused Adam do. The arithmetic is in
the weight's own type (float32 or float64), in the order `rules.py` writes it for NumPy, so
the two agree to that type's rounding. Other dtypes (float16, bfloat16) keep the array
operations. Taught in "Compilers and Interpreters" with the fused kernels of hybridize.
"""
import functools

import numpy

C_TYPES = {numpy.dtype('float32'): 'float', numpy.dtype('float64'): 'double'}

# (settings, arrays written, the statement); each setting and array is a name of `rules.py`
SGD = (('learning_rate', 'wd', 'rescale_grad'), ('weight',),
       'T g = rescale_grad * grad + wd * weight; '
       'weight = weight - learning_rate * g')
SGD_MOMENTUM = (('learning_rate', 'momentum', 'wd', 'rescale_grad'), ('weight', 'velocity'),
                'T g = rescale_grad * grad + wd * weight; '
                'velocity = momentum * velocity - learning_rate * g; '
                'weight = weight + velocity')
ADAM = (('rate', 'beta1', 'beta2', 'epsilon', 'wd', 'rescale_grad'), ('weight', 'mean', 'var'),
        'T g = rescale_grad * grad + wd * weight; '
        'mean = beta1 * mean + (1 - beta1) * g; '
        'var = beta2 * var + (1 - beta2) * (g * g); '
        'weight = weight - rate * mean / (sqrt(var) + epsilon)')


def fits(xp, weight):
    """Whether a kernel runs this update: CuPy arrays of float32 or float64."""
    return xp is not numpy and weight.dtype in C_TYPES


@functools.lru_cache(maxsize=None)
def kernel(xp, rule, dtype):
    """The ElementwiseKernel of `rule` (SGD, SGD_MOMENTUM or ADAM) for `dtype`, compiled once
    per process (CuPy caches the binary on disk too); its settings come in as scalars of the
    weight's type, its arrays as references written in place."""
    settings, written, statement = rule
    ctype, name = C_TYPES[numpy.dtype(dtype)], numpy.dtype(dtype).name
    inputs = ', '.join([f'{name} grad'] + [f'{name} {s}' for s in settings])
    outputs = ', '.join(f'{name} {w}' for w in written)
    return xp.ElementwiseKernel(inputs, outputs, statement.replace('T ', f'{ctype} '),
                                f'd2lperf_{"_".join(written)}_update')


def sgd(xp, learning_rate, momentum, wd, rescale_grad, grad, weight, velocity):
    if velocity is None:
        kernel(xp, SGD, weight.dtype)(grad, learning_rate, wd, rescale_grad, weight)
    else:
        kernel(xp, SGD_MOMENTUM, weight.dtype)(grad, learning_rate, momentum, wd, rescale_grad,
                                               weight, velocity)


def adam(xp, rate, beta1, beta2, epsilon, wd, rescale_grad, grad, weight, mean, var):
    kernel(xp, ADAM, weight.dtype)(grad, rate, beta1, beta2, epsilon, wd, rescale_grad, weight,
                                   mean, var)
