"""What a report section is, and the registry each section module adds its :class:`Section` to when
imported, so that the page (:mod:`kvprobe.reports.html`) needs no list of sections of its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvprobe.reports.folder import Run


@dataclass(frozen=True)
class Section:
    """One section of the report.

    ``title`` is shown after the section's number (its place in ``order`` among all registered
    sections); ``needs`` names what a folder lacks when ``build(run)`` returns None ("Not in this folder
    (no ...)"); ``build`` returns the context its ``template`` (a path under ``templates/``) draws from
    as ``d``; ``tables`` are parquet files it reads that :mod:`kvprobe.reports.folder` does not load
    already, so a section with a new table needs no edit elsewhere. ``template_dir`` is a folder that
    holds ``template`` for a section defined outside kvprobe (None: kvprobe's own ``templates/``).
    """

    id: str
    title: str
    needs: str
    intro: str
    order: float
    build: Callable[[Run], dict | None]
    template: str
    tables: tuple[str, ...] = ()
    template_dir: str | None = None


SECTIONS: dict[str, Section] = {}


def register(section: Section) -> Section:
    """Add ``section`` to :data:`SECTIONS` (ids and orders must be unique); returns it."""
    if section.id in SECTIONS:
        raise ValueError(f"report section {section.id!r} is registered twice")
    clash = [s.id for s in SECTIONS.values() if s.order == section.order]
    if clash:
        raise ValueError(f"report section {section.id!r} has the order {section.order} of {clash[0]!r}")
    SECTIONS[section.id] = section
    return section


def in_order() -> list[Section]:
    """The registered sections in page order."""
    return sorted(SECTIONS.values(), key=lambda s: s.order)
