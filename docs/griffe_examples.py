"""A griffe extension for the API pages: ``Example:`` sections are rendered as examples.

Our docstrings use Google style with a singular ``Example:`` heading (run by
``pytest --doctest-modules``); griffe parses only the plural ``Examples:`` as an examples
section (code rendered as a Python console session) and would render the singular one as
plain Markdown, where doctest output such as ``[1.0, 0.5]`` reads as a link. This
extension renames the heading before the docstring is parsed. The site build only.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", flags=re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Renames ``Example:`` section headings to ``Examples:`` in every docstring."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)


class GeneratedFunctions(griffe.Extension):
    """Documents stage factories whose signature is derived at import from the imported
    function: its ``__signature__`` and ``__doc__``.

    ``opake_fx.dpsgd.clipping.stage`` generates ``clip``, ``auto_clip`` and
    ``adaptive_clip`` from their clipping functions (the source holds calls, not
    ``def``s: griffe's static reading would skip them), and the noise stages are
    ``@signature_of(mechanism) def noise(**arguments)`` (statically, a signature of
    ``**arguments`` alone). The site build only.
    """

    FACTORIES = frozenset({"_stage_of"})
    DECORATORS = ("signature_of",)  # opake_fx.signatures: a factory given its function's signature

    def on_module_members(self, *, mod: Any, **kwargs: Any) -> None:
        generated = [
            name for name, member in mod.members.items()
            if not member.is_alias and (
                (member.is_attribute and isinstance(member.value, griffe.ExprCall)
                 and str(member.value.function) in self.FACTORIES)
                or (member.is_function and any(str(d.value).startswith(self.DECORATORS) for d in member.decorators))
            )
        ]
        if not generated:
            return
        import sys

        inspected = griffe.inspect(mod.path, filepath=mod.filepath, import_paths=sys.path,
                                   extensions=griffe.load_extensions(ExampleSections))
        for name in generated:
            mod.set_member(name, inspected.members[name])
