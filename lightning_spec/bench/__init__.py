"""Measuring drafters: tau and wall-clock speedup against baselines, and tree calibration.

* `runner`: `run_bench`, every method on every prompt, interleaved per prompt (docs/benchmarking.md).
* `report`: per-prompt results -> rows with bootstrap intervals, markdown tables, strict JSON.
* `machine`: cores, threads, versions, load average and git commit recorded with each result.
* `calibrate`: verification cost curve and per-depth acceptance -> the tree policy with the
  best modelled speedup on this device.

The command lines are `lightning-spec bench` and `lightning-spec calibrate`
(`lightning_spec.cli.bench`, `lightning_spec.cli.calibrate`); the strings they accept for
targets, drafters, prompt sets and trees are resolved by `lightning_spec.specs`.
"""
