"""Ctrl-C held back while the main thread runs the engine's operations, so that none is cut in
half: the handler that only notes the signal, and gives it back once the operation in hand is
done. Taught in "Asynchronous Computation".
"""
import threading
# The C functions behind `signal.signal` and `signal.getsignal`: the public wrappers convert
# handlers to enums, which costs five times the system call, on every helped wait.
from _signal import SIGINT, getsignal, signal as set_signal_handler
from _thread import get_ident


class CtrlC:
    """Ctrl-C held back while the main thread runs a lane's operations (`Worker.run_here_until`).

    With helping off, Ctrl-C finds the waiting main thread asleep; the operations run on,
    whole, on their lane's thread. A main thread that helps runs them itself, and Python
    raises KeyboardInterrupt at its next bytecode: inside an operation (half done, its value
    lost) or inside the engine's bookkeeping (a lane left locked, an operation taken from its
    queue and never run: later waits hang). So while the main thread helps (the only thread
    that Python delivers signals to), SIGINT's handler is this object, which only notes the
    signal. `release` puts the handler back and calls it once the operation in hand has
    completed and the lane is free: the caller gets its KeyboardInterrupt, nothing is lost.
    """

    __slots__ = ('handler', 'noted', 'frame')

    def __init__(self):
        self.handler, self.noted, self.frame = None, False, None     # noted: only while held

    def hold(self):
        """Hold Ctrl-C back if this is the main thread and SIGINT has a Python handler (not
        ignored, nor the default that ends the process) that is not this one already (an
        operation the main thread helps with may wait in turn); True if it now does. Every
        short push asks (`ThreadedEngine.push_short`): the two system calls that swap the
        handler are most of its cost, so nothing else is done."""
        if get_ident() != MAIN_THREAD:
            return False
        handler = getsignal(SIGINT)
        if handler is self or not callable(handler):
            return False
        self.handler = handler
        set_signal_handler(SIGINT, self)      # a SIGINT already pending raises first
        return True

    def __call__(self, signum, frame):
        self.noted, self.frame = True, frame

    def release(self):
        """Give SIGINT its handler back; call it if Ctrl-C came while it was held."""
        handler = self.handler
        try:
            set_signal_handler(SIGINT, handler)   # a SIGINT still pending is noted first
        finally:                # even if a new one raised at once: this one goes with it
            noted, self.noted = self.noted, False
        if noted:
            frame, self.frame = self.frame, None
            handler(SIGINT, frame)


ctrl_c = CtrlC()           # one is enough: only the main thread holds it
MAIN_THREAD = threading.main_thread().ident    # compared on every help and short push
