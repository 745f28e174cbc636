"""Training: where a model is trained, from a dataset's matrix to a stored version.

:mod:`.job` runs one training job (read the dataset, plan the device, train, store) for the
daemon's job process and ``ds-ops train`` alike. :mod:`.fit` trains in memory, :mod:`.stream`
a dataset larger than memory, :mod:`.distributed` and :mod:`.ddp_rank` one dataset on several
ranks; the three share :mod:`.common` (the run's set-up, checkpoints, results) and
:mod:`.step` (one optimizer step, eager or a CUDA graph); :mod:`.stacked` trains many small
datasets of one shape as one stack of models, each as it would be alone. :mod:`.stopping` decides when
training stops, :mod:`.suspect` warns about a model that looks wrong, :mod:`.report` draws a
version's ``report.png``; :mod:`.records` holds what the daemon reads of a job, without torch. What a model is and computes (the network, scaling, threshold) is
:mod:`opt_ds_ops.model`.
"""
