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
