"""``python -m towers.cluster.server``: serve this task's towers (``TF_CONFIG``,
``TOWERS_PER_TASK``) until killed or until its parent process dies."""

import os
import time

from towers.cluster.runtime import start_server

if __name__ == "__main__":
    server = start_server()
    print(f"serving {server.target}", flush=True)
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)
