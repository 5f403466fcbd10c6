"""Run by the zygote's tests as `python -m zygote_probe MODE [CODE]`: says what kind of process it is, as JSON."""

import json
import os
import signal
import sys

if sys.argv[1] == "sleep":
    print("sleeping", flush=True)
    signal.pause()  # until a signal ends it
import torch

print(
    json.dumps(
        {
            "argv": sys.argv[1:],
            "probe": os.environ.get("PROBE"),
            "session_leader": os.getsid(0) == os.getpid(),
            "stdin": os.readlink("/proc/self/fd/0"),
            "cmdline": open("/proc/self/cmdline").read().replace("\0", " ").strip(),
            "threads": torch.get_num_threads(),
            "main": __name__,
            "cores": sorted(os.sched_getaffinity(0)),
        }
    )
)
sys.exit(int(sys.argv[2]))
