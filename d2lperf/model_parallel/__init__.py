"""Model parallelism: the model itself split over devices, as a Transformer is trained today.

    schedules   pipeline schedules as data (GPipe, 1F1B, interleaved 1F1B), what they imply
                before anything runs (the bubble, the micro-batches a stage holds), and a
                simulator that times them.
    pipeline    a net's layers cut into stages on devices and trained by a schedule, the
                copies between stages engine operations.

Taught in "Model Parallelism".
"""
from .schedules import Action, SCHEDULES, bubble, in_flight, schedule, simulate
from .pipeline import Pipeline

__all__ = ['Action', 'SCHEDULES', 'Pipeline', 'bubble', 'in_flight', 'schedule', 'simulate']
