"""Health: where a GPU's health is judged and a job's device is decided.

:mod:`.nvml` reads the driver and each GPU through NVML (nvidia-ml-py), in ``nvidia-smi``'s
vocabulary (pstate, throttle reasons, ECC, retired pages); :mod:`.policy` turns the readings
into a verdict per GPU (healthy, degraded, unusable; :mod:`.findings` judges one GPU's reading,
without torch) and a job's gate; :mod:`.smoke` runs a short CUDA test; :mod:`.device` plans the
device and autocast dtype a job gets (the CPU where there is no usable GPU); :mod:`.gpustats`
samples a GPU while a job trains on it.
"""
