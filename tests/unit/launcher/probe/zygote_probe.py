"""Run by the zygote's tests as `python -m zygote_probe MODE [CODE]`: says what kind of process it is, as JSON.
MODE sleep: waits for a signal; streams: its cwd on stdout, a line on stderr, after 0.5 s of CPU; nest: makes a
zygote of its own and runs `report 3` through it; report: the JSON."""

import gc
import json
import os
import signal
import sys
import time

if sys.argv[1] == "sleep":
    print("sleeping", flush=True)
    signal.pause()  # until a signal ends it
if sys.argv[1] == "streams":
    start = time.process_time()
    while time.process_time() - start < 0.5:
        pass
    print(f"out {os.getcwd()}", flush=True)
    print("err", file=sys.stderr, flush=True)
    sys.exit(0)
if sys.argv[1] == "nest":
    from asyncrl.launcher import zygote

    z = zygote.Zygote("nested", __import__("pathlib").Path(sys.argv[2]))
    child = z.spawn([sys.executable, "-m", "zygote_probe", "report", "3"], None, dict(os.environ))
    said = {"forked_zygote": isinstance(z.proc, zygote.Forked), "code": child.wait(120) if child else None}
    z.close()
    print(json.dumps(said), flush=True)
    sys.exit(0)
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
            "path": sys.path[:3],
            "gc": gc.isenabled(),
            "frozen": gc.get_freeze_count(),
        }
    )
)
sys.exit(int(sys.argv[2]))
