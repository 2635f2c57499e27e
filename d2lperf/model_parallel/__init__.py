"""Model parallelism: the model itself split over devices, as a Transformer is trained today.

    schedules   pipeline schedules as data (GPipe, 1F1B, interleaved 1F1B), what they imply
                before anything runs (the bubble, the micro-batches a stage holds), and a
                simulator that times them.

Taught in "Model Parallelism".
"""
from .schedules import Action, SCHEDULES, bubble, in_flight, schedule, simulate

__all__ = ['Action', 'SCHEDULES', 'bubble', 'in_flight', 'schedule', 'simulate']
