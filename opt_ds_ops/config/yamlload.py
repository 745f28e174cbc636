"""How ds-ops reads its YAML (the conffile, sidecars, source files): PyYAML's SafeLoader, with a
number in exponent notation read as a number (``lr: 1e-3``) and, for source files, a key given
twice in one mapping refused.

PyYAML implements YAML 1.1, whose float needs a dot (``1.0e-3``): ``1e-3`` is the text "1e-3"
there, and a conffile that says ``train.lr: 1e-3`` would be refused as "not a number". YAML 1.2
(and every other YAML reader a user may have checked the file with) reads it as 0.001.
:class:`ConfigLoader` adds YAML 1.2's float forms to SafeLoader's; everything else is unchanged
(``yes``/``off`` stay booleans, as YAML 1.1 says).
"""

from __future__ import annotations

import re

import yaml


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-3``, ``5E+2`` and ``1.5e3`` as floats (YAML 1.2), not as text."""


# YAML 1.1's float needs a dot and a signed exponent; YAML 1.2's core schema does not. Tried after
# SafeLoader's own resolvers (int, 1.1's float), so only what they left as text is read so; the class
# gets its own copy of the resolvers (PyYAML copies them on the first add), SafeLoader is unchanged.
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                   re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
                                   list("-+0123456789."))


class UniqueKeyLoader(ConfigLoader):
    """:class:`ConfigLoader` that refuses a key given twice in one mapping (SafeLoader keeps the
    last silently; a merge key ``<<`` is YAML's own way to repeat keys and stays allowed)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:
                    continue  # an unhashable key: SafeLoader's own error names it
                if duplicate:
                    raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                            f"found the key {key!r} twice", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)
