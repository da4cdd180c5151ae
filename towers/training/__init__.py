"""What Keras lacks around the step: exact checkpoints and resume, replica sync, export, data.

    inference.py   the towers' inference pass of ``TowerModel.evaluate`` / ``predict``
    keras_copies.py  a Keras model and optimizer copied onto a device, whole (a replica's parts)
    losses.py      a Keras loss as compile prepares it; one per model output (loss_weights)
    checkpoint.py  ``save`` / ``restore``: every replica, optimizer slots, codec state
    signature.py   what a checkpoint holds (optimizer, model, placement); restore refuses others
    atomic.py      numbered checkpoints written atomically; ``latest`` skips damaged ones
    backup.py      ``ExactResume``: a callback saving every k batches, resuming at the batch
    export.py      ``.keras`` and SavedModel export of the trained model
    data.py        scikit-learn's bundled 8×8 digits, split and batched
    models.py      the small models the CLI, examples and benchmarks train
"""
