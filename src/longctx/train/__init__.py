"""One training run: set-up (setup.py: config -> run directory, data, model, checkpoints; model.py:
the model by its kind's builder, weights.py: starting weights), the loop (trainer.py:
`Trainer(cfg).run()`, `train(cfg)`) and its step hooks (hooks.py; moe_hooks.py: the routers'
bookkeeping), LONGCTX_FAULT's faults as a wrapper around the step (fault_injection.py), when to save
(saves.py), what watches the loop (watch.py), progressive lengths (stages.py), the checks made before any rank starts
(preflight.py), metrics and plots (metrics.py, report.py). A step's pieces, which the planner's
validation measures too, live below in longctx/step/. Nothing is imported here."""
