"""What a run will cost before it starts: per-rank memory (:mod:`~xscale.estimate.memory`), the pipeline's
microbatches in flight (:mod:`~xscale.estimate.in_flight`) and a step measured on fake tensors
(:mod:`~xscale.estimate.measure`). Above ``parallel``, below ``train``: the training step a measurement runs is
passed in (:class:`~xscale.estimate.step_runner.StepRunner`). The pipeline's stage costs stay with the pipeline
(:mod:`xscale.parallel.pipeline.cost`), which balances its stages with them."""
