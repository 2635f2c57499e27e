"""What a model takes on a device, counted before anything runs: the bytes its states hold
by kind, whole or sharded over the devices of data parallelism (ZeRO's table, Rajbhandari et
al., 2020), and the bytes a Transformer layer keeps for backward (Korthikanti et al., 2022).

Both calculators build on these: `data_parallel.predict` (ZeRO and its traffic, "Data
Parallelism at Scale") and `model_parallel.predict` (a data × tensor × pipeline layout,
"Parallelism in Three Dimensions"), which may not import from each other's layer.
"""
from __future__ import annotations

STATE_VALUES = {'sgd': 0, 'momentum': 1, 'adam': 2}      # values the optimizer keeps a weight
STAGES = (0, 1, 2, 3)            # 0: plain data parallelism
SHARDED_FROM = {'optimizer state': 1, 'master weights': 1, 'gradients': 2, 'weights': 3}
ZERO_PAPER = {'weights': 2, 'gradients': 2, 'optimizer state': 12}     # ZeRO's Figure 1
# Megatron-LM's mixed precision: 16-bit weights, float32 gradients (summed over devices in
# float32), a float32 master copy and Adam's two values; 18 bytes, 6 + 12/d at stage 1 (its
# distributed optimizer)
MEGATRON = {'weights': 2, 'gradients': 4, 'master weights': 4, 'optimizer state': 8}


def model_states(num_params: float, devices: int, stage: int,
                 bytes_per_kind: dict[str, float] = ZERO_PAPER) -> dict[str, float]:
    """{kind: bytes one device holds, ..., 'total': their sum} at this ZeRO stage.

    Each kind is whole on every device below the stage that shards it (`SHARDED_FROM`) and
    divided by the devices from there on, ZeRO's and FSDP's rule alike."""
    check(devices, stage)
    unknown = set(bytes_per_kind) - set(SHARDED_FROM)
    if unknown:
        raise ValueError(f'the calculator knows the model-state kinds {sorted(SHARDED_FROM)}, '
                         f'not {sorted(unknown)} (activations depend on the batch: measure them)')
    held = {kind: num_params * size / (devices if stage >= SHARDED_FROM[kind] else 1)
            for kind, size in bytes_per_kind.items()}
    return {**held, 'total': sum(held.values())}


def transformer_layer_activations(seq, batch, hidden, heads, value_bytes=2, dropout=True):
    """Bytes one Transformer layer keeps for its backward pass (Korthikanti et al., 2022):
    with 16-bit values and one-byte dropout masks, s·b·h·(34 + 5·a·s/h).

    In values: 16·sbh of inputs the layer's products, norms and GELU need (the norms' inputs,
    Q, K, V, the inputs of both MLP products and of the output projection) and a·s²·b for the
    attention probabilities; dropout adds its output after the softmax (a·s²·b more values)
    and three masks of a byte a value (2·sbh + a·s²·b)."""
    sbh, as2b = seq * batch * hidden, heads * seq * seq * batch
    values = 16 * sbh + as2b + dropout * as2b
    return value_bytes * values + dropout * (2 * sbh + as2b)


def check(devices, stage, optimizer='sgd'):
    if stage not in STAGES:
        raise ValueError(f'a ZeRO stage is 0 (plain data parallelism), 1, 2 or 3, not {stage!r}')
    if optimizer not in STATE_VALUES:
        raise ValueError(f'unknown optimizer {optimizer!r}: the calculator knows '
                         f'{sorted(STATE_VALUES)}')
    if not (isinstance(devices, int) and devices >= 1):
        raise ValueError(f'devices is a whole number of at least 1, not {devices!r}')
