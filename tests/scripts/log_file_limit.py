"""Keep a metrics trail under a file-size limit (``RLIMIT_FSIZE``): a full disk, for real.

Run as ``python log_file_limit.py LOG_DIR LIMIT_BYTES STEPS``. The kernel refuses
every write past ``LIMIT_BYTES`` (``EFBIG``, the ``ENOSPC`` of one process), the
way a full disk does: ``distributed()`` either refuses the folder (a limit too
small for its probe), or the jsonl logger meets the limit mid-run. Prints
``REFUSED: <message>`` or ``WARNED: <message>`` for each warning, then ``DONE``.
"""

from __future__ import annotations

import resource
import signal
import sys
import warnings

from ddpctx import distributed

log_dir, limit, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, not the process
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        with distributed(log_dir=log_dir, loggers=("jsonl",)) as ctx:
            for step in range(steps):
                ctx.log({"loss": step / 7, "tokens": step * 1000})
    except ValueError as error:
        print(f"REFUSED: {error}")
for warning in caught:
    print(f"WARNED: {warning.message}")
print("DONE")
