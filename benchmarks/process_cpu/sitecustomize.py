"""Put this folder on PYTHONPATH with PROCESS_CPU_LOG=FILE set, and every Python process that starts (pytest's
workers, the CLI, simulators, servers, the tests' reference loops) appends one JSON line to FILE when it ends:
its pid, argv, multiprocessing name, own CPU seconds (user + system, not its children's), lifetime, the test
that started it (pytest's PYTEST_CURRENT_TEST, which children inherit) and whether it loaded the sentence
model, torch or LIBERO. A process killed by a signal writes nothing. `benchmarks/process_cpu.py FILE` sums it up.
"""

import os
import sys
import time

_STARTED = time.time()
_LOG = os.environ.get("PROCESS_CPU_LOG")
_written = False


def _write() -> None:
    global _written
    if _written:  # at exit, from whichever of atexit and multiprocessing's finalizers runs first
        return
    _written = True
    try:
        import json
        import multiprocessing

        t = os.times()
        record = {
            "pid": os.getpid(), "argv": sys.argv[:6], "mp": multiprocessing.current_process().name,
            "cpu": t.user + t.system, "wall": time.time() - _STARTED, "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
            "sentence_model": "sentence_transformers" in sys.modules, "torch": "torch" in sys.modules,
            "libero": "libero" in sys.modules,
        }
        with open(_LOG, "a") as f:
            f.write(json.dumps(record) + "\n")
    except Exception:
        pass


if _LOG:
    import atexit

    atexit.register(_write)
    try:  # a multiprocessing child ends with os._exit, after its finalizers but without atexit
        from multiprocessing import util

        util.Finalize(None, _write, exitpriority=-100)
    except Exception:
        pass
