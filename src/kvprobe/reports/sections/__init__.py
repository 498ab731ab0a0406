"""The report's sections: one module per section, each registering its :class:`Section` when imported.

Importing this package imports every module in it, so a new section is one module here (its builder
and its :class:`Section`) plus its template in ``templates/sections/``; nothing else lists sections.
"""

from __future__ import annotations

import importlib
import pkgutil

from kvprobe.reports.sections.registry import SECTIONS, Section, in_order, register

__all__ = ["SECTIONS", "Section", "in_order", "register"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
