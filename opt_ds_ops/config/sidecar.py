"""The sidecar: a user's options for one dataset, ``NAME.yaml`` dropped beside ``NAME.csv``.

Its keys are the conffile's ``dataset:`` keys plus ``name`` (the model's name). Its bytes are a
group member's: they are parsed only here, and only in a job process or a command a user runs,
never in the daemon (docs/trust.md); the parser is bounded (:data:`SIDECAR_MAX_BYTES`, the
conffile's guarded YAML loader) and fuzzed (tests/fuzz).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .conffile import ConfigError, DatasetConfig, _build_guarded, _parse_yaml_bytes, _shown, _sorted_keys

SIDECAR_SUFFIXES = (".yaml", ".yml")
SIDECAR_MAX_BYTES = 64 * 1024


def parse_sidecar(text: bytes, where: str, base: DatasetConfig) -> tuple[DatasetConfig, str | None]:
    """Given a sidecar's bytes (``NAME.yaml`` dropped beside dataset NAME), return (the dataset
    options: ``base`` with the sidecar's keys applied, the model name it sets or None).

    A sidecar is a YAML mapping with the keys of the conffile's ``dataset:`` section plus ``name``
    (the model's name, instead of the file's stem; ``model`` is a synonym), validated the same way. Raises ConfigError
    naming ``where`` and the key for: more than SIDECAR_MAX_BYTES (64 KiB), invalid YAML or UTF-8
    (nesting deeper than the parser follows, 20,000 ``[``, too), not a mapping, an unknown key (of
    any type: ``1:`` beside ``foo:``), a wrong type or value.
    """
    raw = _parse_yaml_bytes(text, where, SIDECAR_MAX_BYTES, "sidecar")
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: a sidecar must be a mapping of dataset keys, got {type(raw).__name__}")
    raw = dict(raw)
    name, model = raw.pop("name", None), raw.pop("model", None)  # model: says the same as name:
    if name is not None and model is not None:
        raise ConfigError(f"{where}: keys 'name' and 'model' both name the model; give one")
    name = model if name is None else name
    if name is not None and (not isinstance(name, (str, int)) or isinstance(name, bool) or not str(name).strip()):
        raise ConfigError(f"{where}: key 'name' must be a model name (text), got {_shown(name)}")
    allowed = {f.name for f in dataclasses.fields(DatasetConfig)}
    unknown = _sorted_keys(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key '{unknown[0]}' (allowed: name (or model), {', '.join(sorted(allowed))})")
    merged = dict(dataclasses.asdict(base), **raw)
    return _build_guarded(DatasetConfig, merged, where), (str(name).strip() if name is not None else None)
