"""Real Ctrl-Cs at random moments: the engine never hangs and never loses a value (issue 43 §1).

    python benchmarks/ctrl_c_stress.py                 # 60, 40, 40 trials a workload and engine
    python benchmarks/ctrl_c_stress.py --trials 10     # each workload's count × 10 / 60
    make stress-ctrl-c

Outside the unit tests, so that CI stays within its budget. Each (workload, engine) runs in a
child process; in it, every trial starts the workload from a known state while a timer thread
sends the process a real SIGINT (`os.kill`) at a random moment of it, as a user pressing
Ctrl-C would. A trial passes when:

* the statement the SIGINT landed in raised KeyboardInterrupt, never an OperationError (a
  Ctrl-C turned into a failure loses what the operation wrote);
* every wait afterwards returns within its timeout (a watchdog ends the child and reports the
  trial as a hang otherwise), nothing is left in flight and no waiter is left;
* the values are right: a chain of additions holds exactly the additions that returned; a
  pipeline step (GPT, tensor 2 × pipeline 2, 1F1B, Adam) leaves each weight either as before the
  step or as the same step without Ctrl-C makes it (an update is one operation: all or
  nothing); after a ZeRO stage 2 step (Adam, two devices) every weight is readable and
  finite; and the next step, without Ctrl-C, then gives the right values.

Workloads: `chain` (3,000 `x = x + 1` and `x.asnumpy()`), `pipeline`, `zero`; on the threaded
engine (helping waits on, the default) and the naive one.
"""
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy

HANG_SECONDS = 60          # a trial longer than this has hung: the child reports it and ends
TRIALS = {'chain': 60, 'pipeline': 40, 'zero': 40}


class Watchdog:
    """Ends the process, printing what was running, if a trial runs past HANG_SECONDS."""

    def __init__(self, results):
        self.results, self.deadline = results, None
        threading.Thread(target=self.watch, daemon=True).start()

    def watch(self):
        while True:
            time.sleep(0.5)
            if self.deadline is not None and time.monotonic() > self.deadline:
                import faulthandler
                faulthandler.dump_traceback(sys.stderr)
                self.results['hangs'] += 1
                print(json.dumps(self.results), flush=True)
                os._exit(3)

    def arm(self):
        self.deadline = time.monotonic() + HANG_SECONDS

    def disarm(self):
        self.deadline = None


def with_ctrl_c_after(seconds, statements):
    """Run `statements()` while a timer thread sends this process SIGINT `seconds` later;
    'interrupted' if KeyboardInterrupt came out, 'failed: ...' for an OperationError, or
    'finished' (the SIGINT then came after; it is waited for, inside, so it lands here)."""
    from d2lperf import engine
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        statements()
        timer.join()                      # a Ctrl-C that comes late still lands in here
        time.sleep(0.001)
        return 'finished'
    except KeyboardInterrupt:
        timer.join()
        return 'interrupted'
    except engine.OperationError as error:
        timer.join()
        return f'failed: {error}'


def settled():
    """Wait for everything; True if nothing is left in flight and no waiter is left."""
    from d2lperf import engine
    engine.wait_all()
    eng = engine.current()
    deadline = time.monotonic() + 5       # a waiter runs just after the operation it waits for
    while getattr(eng, 'waiters', 0) and time.monotonic() < deadline:
        time.sleep(0.001)
    return eng.in_flight == 0 and getattr(eng, 'waiters', 0) == 0


# -- the workloads: each returns (setup, statements, check) for one trial ---------------------

def chain_trial(rng):
    from d2lperf import np
    steps, box = 3000, {}

    def statements():
        x, box['done'] = np.zeros((2,)), 0
        for _ in range(steps):
            x = x + 1
            box['done'] += 1              # nothing can land between the statement and this
            box['x'] = x
        box['value'] = x.asnumpy()

    def check():
        x = box.get('x')
        if x is None:
            return True
        right = x.asnumpy().tolist() == [box['done']] * 2
        return right and (x + 1).asnumpy().tolist() == [box['done'] + 1] * 2
    return statements, check


def gpt_pipeline():
    import d2lperf as d2l
    from d2lperf import nn, np
    from d2lperf.model_parallel import parallel_gpt
    vocab, seq, batch = 20, 8, 8
    data = numpy.random.default_rng(0)
    tokens, labels = data.integers(0, vocab, (batch, seq)), data.integers(0, vocab, (batch, seq))
    np.random.seed(0)
    net = nn.GPT(vocab, 2, 16, 4, seq)
    net.initialize(device=d2l.cpu(0))
    split = parallel_gpt(net, [d2l.cpu(i + 1) for i in range(4)], 1, 2, 2, '1f1b')
    params = list(split.collect_params().values())
    initial = [p.data().asnumpy() for p in params]
    loss = d2l.SoftmaxCrossEntropyLoss()

    def step(trainer):
        split.forward_backward(np.array(tokens), np.array(labels), loss, 2)
        trainer.step(batch)

    def fresh_trainer():
        for param, value in zip(params, initial):
            param.set_data(np.array(value, device=param.data().device))
        return d2l.Trainer(split.collect_params(), 'adam', {'learning_rate': 0.01},
                           kvstore=None)
    step(fresh_trainer())
    after = [p.data().asnumpy() for p in params]
    return params, initial, after, step, fresh_trainer


def pipeline_trial(rng, model):
    params, initial, after, step, fresh_trainer = model
    trainer = fresh_trainer()

    def statements():
        step(trainer)

    def check():
        for param, before, stepped in zip(params, initial, after):
            value = param.data().asnumpy()
            if not (numpy.array_equal(value, before)
                    or numpy.allclose(value, stepped, rtol=1e-5, atol=1e-6)):
                return False
        step(fresh_trainer())             # the next step, from the start, is the right one
        return all(numpy.allclose(p.data().asnumpy(), a, rtol=1e-5, atol=1e-6)
                   for p, a in zip(params, after))
    return statements, check


def zero_model():
    import d2lperf as d2l
    from d2lperf import nn, np
    from d2lperf.data_parallel import Zero
    devices = [d2l.cpu(1), d2l.cpu(2)]
    data = numpy.random.default_rng(0)
    x = np.array(data.standard_normal((64, 32)).astype('float32'))
    y = np.array(data.integers(0, 10, 64))
    loss = d2l.SoftmaxCrossEntropyLoss()

    def fresh():
        net = nn.HybridSequential()
        net.add(nn.Dense(64, in_units=32, activation='relu'),
                nn.Dense(64, in_units=64, activation='relu'), nn.Dense(10, in_units=64))
        np.random.seed(0)
        net.initialize(device=devices)
        return net, Zero(net, 2, 'adam', {'learning_rate': 0.01})

    def step(net, zero):
        xs, ys = d2l.split_batch(x, y, devices)
        zero.step(lambda: [loss(net(a), b) for a, b in zip(xs, ys)], 64)
    net, zero = fresh()
    step(net, zero)
    step(net, zero)
    return fresh, step, {k: v for k, v in zero.weights().items()}


def zero_trial(rng, model):
    fresh, step, two_steps = model
    net, zero = fresh()
    step(net, zero)                       # a clean step first; Ctrl-C in the second

    def statements():
        step(net, zero)

    def check():
        weights = zero.weights()
        if not all(numpy.isfinite(w).all() for w in weights.values()):
            return False
        net2, zero2 = fresh()             # the next, from the start, gives the right values
        step(net2, zero2)
        step(net2, zero2)
        return all(numpy.allclose(zero2.weights()[k], v, rtol=1e-5, atol=1e-6)
                   for k, v in two_steps.items())
    return statements, check


def checked(check):
    """`check()`, False where it raised (a failed array: a Ctrl-C that became a failure)."""
    try:
        return check()
    except Exception as error:            # noqa: BLE001 - reported, and counted as wrong
        print(f'check raised {type(error).__name__}: {error}', file=sys.stderr)
        return False


def child(workload, kind, trials, seed):
    """Run `trials` trials of `workload` on engine `kind`; print the results as JSON."""
    import d2lperf as d2l
    d2l.engine.use(kind)
    rng = random.Random(seed)
    model = {'pipeline': gpt_pipeline, 'zero': zero_model}.get(workload, lambda: None)()
    make = {'chain': lambda r: chain_trial(r), 'pipeline': lambda r: pipeline_trial(r, model),
            'zero': lambda r: zero_trial(r, model)}[workload]
    statements, _ = make(rng)
    start = time.perf_counter()
    statements()
    d2l.engine.wait_all()
    duration = time.perf_counter() - start
    results = {'workload': workload, 'engine': kind, 'trials': 0, 'interrupted': 0,
               'finished': 0, 'failed': 0, 'hangs': 0, 'wrong': 0, 'left': 0,
               'step_ms': round(duration * 1e3, 1)}
    watchdog = Watchdog(results)
    for _ in range(trials):
        statements, check = make(rng)
        watchdog.arm()
        outcome = with_ctrl_c_after(rng.uniform(0, 1.2 * duration), statements)
        results['trials'] += 1
        results[outcome.split(':')[0]] += 1
        if outcome.startswith('failed'):
            print(outcome, file=sys.stderr)
        results['left'] += not settled()
        results['wrong'] += not checked(check)
        watchdog.disarm()
    print(json.dumps(results), flush=True)


def main():
    if sys.argv[1:2] == ['--child']:
        workload, kind, trials, seed = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        child(workload, kind, trials, seed)
        return
    scale = int(sys.argv[2]) / 60 if sys.argv[1:2] == ['--trials'] else 1
    here = os.path.dirname(os.path.abspath(__file__))
    print(f'| workload | engine | trials | KeyboardInterrupt | none (swallowed) | failed | hangs | wrong '
          f'| left in flight | one step, ms |')
    print('|---|---|--:|--:|--:|--:|--:|--:|--:|--:|')
    total = {'trials': 0, 'bad': 0}
    for seed, (workload, count) in enumerate(TRIALS.items()):
        for kind in ('threaded', 'naive'):
            done = subprocess.run([sys.executable, os.path.join(here, 'ctrl_c_stress.py'),
                                   '--child', workload, kind, str(max(1, round(count * scale))),
                                   str(seed)], capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith('{')]
            if not lines:
                print(f'| {workload} | {kind} | the child ended without results: '
                      f'{done.stderr[-2000:]!r} |')
                total['bad'] += 1
                continue
            r = json.loads(lines[-1])
            print(f"| {workload} | {kind} | {r['trials']} | {r['interrupted']} | "
                  f"{r['finished']} | {r['failed']} | {r['hangs']} | {r['wrong']} | "
                  f"{r['left']} | {r['step_ms']} |", flush=True)
            total['trials'] += r['trials']
            total['bad'] += r['failed'] + r['hangs'] + r['wrong'] + r['left']
    print(f"\n{total['trials']} trials; {total['bad']} failed, hung, wrong or left work in "
          'flight')
    sys.exit(1 if total['bad'] else 0)


if __name__ == '__main__':
    main()
