"""The model store: ``MODELS_DIR/<name>/<version>/`` and ``<name>/current``.

:mod:`.versions` saves a version atomically, loads one back and decides whether a job's new
version becomes ``current``; :mod:`.model_dir` is one model's directory (names, the name lock,
``current``, metadata, the operator log); :mod:`.admin` is what an operator changes with
``ds-ops models`` (pin, promote, rollback, remove) and the pruning of old versions.
"""
