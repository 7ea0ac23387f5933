"""Metrics: the logging config section and the logger (TensorBoard, console, W&B)."""
