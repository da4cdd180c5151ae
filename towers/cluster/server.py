"""``python -m towers.cluster.server``: serve this task's towers until killed (in-graph mode).

Reads ``TF_CONFIG`` (this task) and ``TOWERS_PER_TASK`` (its logical CPUs).
"""

from towers.cluster.runtime import serve

if __name__ == "__main__":
    serve()
