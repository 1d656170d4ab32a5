"""One training run: set-up (setup.py: config -> run directory, data, model, checkpoints), the loop
(trainer.py: `Trainer(cfg).run()`, `train(cfg)`), a step's pieces (step.py, which the planner's
validation measures too), progressive lengths (stages.py), the checks made before any rank starts
(preflight.py), metrics and plots (metrics.py, report.py) and the host-sync detector (host_sync.py).
Nothing is imported here, so `longctx.train.step` loads without the loop."""
