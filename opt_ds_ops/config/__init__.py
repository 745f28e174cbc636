"""Configuration: the conffile ``/etc/ds-ops/trainer.yaml``, parsed once and passed down.

:mod:`.conffile` reads and validates the conffile into a :class:`~.conffile.Config` of frozen
dataclasses, with every default in one place; :mod:`.sidecar` reads a dataset's ``NAME.yaml``
(the ``dataset:`` keys a member may set per file, a model name, incidents), bounded and in the
job process only; :mod:`.yamlpos` gives a YAML error its line and column. Nothing here imports
another folder of the package: every stage below the command line receives what it needs from
here as arguments.
"""
