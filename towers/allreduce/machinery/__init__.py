"""The machinery the all-reduce algorithms are built from and run by (no algorithm here).

::

    base.py              the contract: algorithm(values, *, op) -> outputs; GradientReducer
    primitives.py        send (the one place data moves) and its record: bytes, links, ticks
    registry.py          one record shape (Record) and mapping (Registry) for every registry
    resolve.py           every typed name -> its object: algorithms, codecs, reducer specs
    reducer.py           an algorithm lifted to a whole step's gradients (StepReducer)
    scheduled.py         the one schedule interpreter (run_slots), for every schedule
    packed.py            slots as rows of one tensor (one message per tick and pair); per_tower
    tf_collective_ops.py TensorFlow's collective ops: instance keys, ordering tokens, wire format
    sparse.py            IndexedSlices gathered in tower order, or densified
    sharding.py          the sharded placement's flat chunks, reduce-scatter, all-gather
    rounding.py          the unit roundoff u per dtype and γ_k: what every error bound builds on

The algorithms themselves are the modules of :mod:`towers.allreduce` beside this package.
"""
