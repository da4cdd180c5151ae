"""Everyday training around the step: Keras-style loops, checkpoints, export, demo data.

    fit.py         ``fit`` / ``evaluate`` / ``predict`` with Keras callbacks and exact metrics
    checkpoint.py  ``save`` / ``restore``: every replica, optimizer slots, codec state
    signature.py   what a checkpoint holds (optimizer, model, placement); restore refuses others
    atomic.py      numbered checkpoints written atomically; ``latest`` skips damaged ones
    backup.py      ``fit(checkpoint_dir=...)``: save every k batches, resume bitwise (same data)
    sync.py        replica 0 -> every replica: what ``towers.TowerModel`` copies after Keras writes
    export.py      ``.keras`` and SavedModel export of the trained model
    data.py        scikit-learn's bundled 8×8 digits, split and batched
    models.py      the small models the CLI, examples and benchmarks train
"""
