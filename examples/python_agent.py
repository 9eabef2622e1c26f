"""A minimal agent on the mep Python SDK: claims its name and memory, works in a loop,
syncs the memory under the lease's fence (when mepd has a store), and stops cleanly when
the lease is lost. Run: python3 examples/python_agent.py [NAME] [MEMORY.uai]"""
import os
import sys

import mep

name = sys.argv[1] if len(sys.argv) > 1 else "Example Agent"
path = sys.argv[2] if len(sys.argv) > 2 else "example.uai"
if not os.path.exists(path):
    mep.init(path)  # a new, empty memory with a fresh identity

with mep.lease(name, path, ttl=10) as lease:
    print("holding %s (token %d)" % (lease.canonical_name, lease.token), flush=True)
    lease.on_lost(lambda l: print("lease lost: %s" % l.lost_reason, flush=True))
    step = 0
    while not lease.lost.wait(1.0):  # one unit of work per second, until the lease is lost
        step += 1
        with open(path, "a") as memory:
            memory.write("step %d\n" % step)
        try:
            lease.sync()  # uploaded with the fencing token; a stale one is refused
        except (mep.StoreNotConfigured, mep.NotSupported):
            pass  # this mepd has no data plane: the file stays local
        except mep.LeaseGone:
            break
        print("step %d done" % step, flush=True)
print("stopped")
