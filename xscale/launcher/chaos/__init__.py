"""The chaos soak: a training job run under torchrun with faults injected at seeded random steps, measured.

:mod:`.plan` draws the schedule and names the files the soak and the workers share, :mod:`.report` turns the
timeline into per-fault figures and goodput, :mod:`.soak` runs the jobs and injects the faults from outside; the
faults only a worker can cause (a NaN, a full disk during a save) are injected by :mod:`xscale.train.fault_injection`.
"""
