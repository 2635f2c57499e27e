"""Model parallelism: the model itself split over devices, as a Transformer is trained today.

    schedules   pipeline schedules as data (GPipe, 1F1B, interleaved 1F1B), what they imply
                before anything runs (the bubble, the micro-batches a stage holds), and a
                simulator that times them.
    stage       what a pipeline calls on each part of a model: the Stage interface.
    pipeline    a net's layers cut into stages on devices and trained by a schedule, the
                copies between stages engine operations.
    layers      Megatron-LM's column- and row-parallel Dense layers, f and g inside them, and
                the group whose devices meet at those collectives.
    tensor      Megatron-LM's split of each Transformer layer over devices: attention by
                heads, the MLP by features; a device's share is the GPT made of the
                parallel layers, its forward the GPT's own.
    expert      expert parallelism: a mixture's experts over devices, tokens sent to them
                and back by all-to-all.
    layout      the three at once: data × tensor × pipeline on a grid of devices.
    context     context parallelism: a long sequence split over devices, keys and values
                passed round a ring or all-gathered; the zig-zag layout balances the
                causal mask's work.
    predict     the calculator: the bytes a device holds and a step's seconds for a layout,
                before renting the machines.
    published   the calculator on the papers' models (experts, grouped-query attention):
                DeepSeek-V3's and Llama 3 405B's layouts, where their papers ran them.

Taught in "Model Parallelism".
"""
from .schedules import Action, SCHEDULES, bubble, held_microbatches, schedule, simulate
from .stage import Stage
from .pipeline import Part, Pipeline
from .layers import ColumnParallelDense, RowParallelDense, TensorGroup
from .tensor import TensorParallelGPT, tensor_parallel
from .layout import ParallelGPT, parallel_gpt
from .context import context_parallel_attention
from .expert import ExpertParallelMoE, expert_parallel

__all__ = ['Action', 'SCHEDULES', 'ColumnParallelDense', 'ParallelGPT', 'Part', 'Pipeline',
           'RowParallelDense', 'Stage', 'TensorGroup', 'TensorParallelGPT', 'bubble',
           'context_parallel_attention', 'held_microbatches', 'parallel_gpt', 'schedule',
           'simulate', 'tensor_parallel']
__all__ += ['ExpertParallelMoE', 'expert_parallel']
