"""``towers study``: compare reducers and codecs by loss against bytes and predicted time.

    specs.py    a parsed spec (``ring``, ``fp16``, ``topk(0.1)``, ``powersgd(4)@tree``,
                ``module:NAME``; towers.allreduce.machinery.resolve.parse) -> a fresh
                reducer, its all-reduce counted
    cost.py     one step's gradient bytes (bookkeeping left out), priced by the α-β-γ
                model on 8xH100 and 1024xH100
    run.py      :func:`run_study`: the same start and batches for every reducer, a row a step
    output.py   CSV, PNG curves (loss vs bytes, loss vs predicted time), summary table

Example:
    >>> from towers.study import run_study, plot, summary_table, write_csv   # doctest: +SKIP
    >>> rows = run_study(["ring", "fp16", "topk(0.1)", "powersgd(4)"], devices)  # +SKIP
    >>> write_csv(rows, "study.csv"); plot(rows, "study.png")                  # +SKIP
"""

from __future__ import annotations

from towers.study.cost import SYSTEMS, StepTraffic, step_traffic
from towers.study.output import plot, summary, summary_table, write_csv
from towers.study.run import run_study
from towers.study.specs import Counted, build

__all__ = [
    "SYSTEMS",
    "Counted",
    "StepTraffic",
    "build",
    "plot",
    "run_study",
    "step_traffic",
    "summary",
    "summary_table",
    "write_csv",
]
