"""What Keras lacks around the step: exact checkpoints and resume, replica sync, export, data.

Each module says what it holds; docs/architecture.md maps them.
"""
