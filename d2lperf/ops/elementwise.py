"""Elementwise arithmetic, comparisons and math functions, with NumPy's broadcasting.

Each gradient is unbroadcast to its input's shape (`rules.input_grads`); a Python scalar
input gets none. The C expressions let the GPU back end fuse a chain of these ops into one
kernel.
"""
from .registry import defop
from .rules import compare, floating, input_grads, promote, same, weak_scalars

# -- two inputs ----------------------------------------------------------------------------

defop('add', lambda xp, a, b: xp.add(*weak_scalars(a, b)), promote,
      lambda xp, g, out, a, b: input_grads((a, lambda: g), (b, lambda: g)),
      kind='elementwise', c_expr='{a} + {b}')
defop('subtract', lambda xp, a, b: xp.subtract(*weak_scalars(a, b)), promote,
      lambda xp, g, out, a, b: input_grads((a, lambda: g), (b, lambda: -g)),
      kind='elementwise', c_expr='{a} - {b}')
defop('multiply', lambda xp, a, b: xp.multiply(*weak_scalars(a, b)), promote,
      lambda xp, g, out, a, b: input_grads((a, lambda: g * b), (b, lambda: g * a)),
      kind='elementwise', c_expr='{a} * {b}')
defop('divide', lambda xp, a, b: xp.divide(*weak_scalars(a, b)), floating,
      lambda xp, g, out, a, b: input_grads((a, lambda: g / b), (b, lambda: -g * out / b)),
      kind='elementwise', c_expr='{a} / {b}')
defop('power', lambda xp, a, b: xp.power(*weak_scalars(a, b)), promote,
      lambda xp, g, out, a, b: input_grads((a, lambda: g * b * xp.power(a, b - 1)),
                                           (b, lambda: g * out * xp.log(a))),
      kind='elementwise', c_expr='pow({a}, {b})')
defop('maximum', lambda xp, a, b: xp.maximum(*weak_scalars(a, b)), promote,
      lambda xp, g, out, a, b: input_grads((a, lambda: g * (a >= b)), (b, lambda: g * (a < b))),
      kind='elementwise', c_expr='max({a}, {b})')
defop('minimum', lambda xp, a, b: xp.minimum(*weak_scalars(a, b)), promote,
      lambda xp, g, out, a, b: input_grads((a, lambda: g * (a <= b)), (b, lambda: g * (a > b))),
      kind='elementwise', c_expr='min({a}, {b})')

for _name in ('greater', 'less', 'equal', 'greater_equal', 'less_equal', 'not_equal'):
    defop(_name, lambda xp, a, b, _f=_name: getattr(xp, _f)(a, b), compare, kind='compare')

# -- one input -----------------------------------------------------------------------------

defop('negative', lambda xp, a: xp.negative(a), same, lambda xp, g, out, a: (-g,),
      kind='elementwise', c_expr='-{a}')
defop('exp', lambda xp, a: xp.exp(a), floating, lambda xp, g, out, a: (g * out,),
      kind='elementwise', c_expr='exp({a})')
defop('log', lambda xp, a: xp.log(a), floating, lambda xp, g, out, a: (g / a,),
      kind='elementwise', c_expr='log({a})')
defop('sqrt', lambda xp, a: xp.sqrt(a), floating, lambda xp, g, out, a: (g / (2 * out),),
      kind='elementwise', c_expr='sqrt({a})')
defop('abs', lambda xp, a: xp.abs(a), same, lambda xp, g, out, a: (g * xp.sign(a),),
      kind='elementwise', c_expr='fabs({a})')
defop('tanh', lambda xp, a: xp.tanh(a), floating, lambda xp, g, out, a: (g * (1 - out * out),),
      kind='elementwise', c_expr='tanh({a})')
