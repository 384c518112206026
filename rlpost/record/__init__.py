"""What a run records: metrics.jsonl and its trackers (TensorBoard, wandb, MLflow), the Ray metrics,
the run directory's layout, TorchRL's loggers and timers (``torchrl.record``, ``torchrl._utils.timeit``)."""
