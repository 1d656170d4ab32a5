"""The pieces of one training step that the training loop (train/), the planner's validation and the
benchmarks share, below all of them: the optimizer and its guarded step (optimizer.py), the
learning-rate schedule (schedule.py), gradient sync and clipping (gradients.py), the loss forward
(loss.py). Nothing here knows about runs, data stores, metrics or checkpoints."""
