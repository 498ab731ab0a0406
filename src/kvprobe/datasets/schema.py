"""The field-edit case: one prompt, one mutable field, the answer before and after the edit.

A JSONL case file holds exactly ``EditCase.model_dump(mode="json")``, one case per line.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvprobe.datasets.layouts import FieldStyle, Layout

Position = Literal["early", "middle", "late"]
POSITIONS: tuple[Position, ...] = ("early", "middle", "late")


class Demo(BaseModel):
    """A few-shot demonstration: a fully rendered prompt body and its answer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    body: str = Field(min_length=1)
    answer: str = Field(min_length=1)


def _check_value(name: str, value: str) -> None:
    if not value or value != value.strip() or "\n" in value:
        raise ValueError(f"{name} must be non-empty, one line, without surrounding spaces; got {value!r}")


class EditCase(BaseModel):
    """One case: a prompt whose record holds ``field``, edited from ``old_value`` to ``new_value``.

    Structured form (the generator's): ``rule``, ``fillers``, ``record``, ``context`` and
    ``field_position`` are assembled into the body. Free form (user datasets): ``prompt`` is the
    body, and must contain ``old_value`` exactly once, as a whole word; the question follows it.

    ``control`` marks a negative control (timestamp, nonce, request_id): the edit must not
    change the answer, so ``expected_old == expected_new``. Otherwise the edit flips it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    case_id: str = Field(min_length=1)
    domain: str = Field(min_length=1)
    field: str = Field(min_length=1)
    old_value: str
    new_value: str
    control: bool
    system: str | None = None
    prompt: str | None = None  # a free-form body holding old_value exactly once (user datasets)
    rule: str = ""
    fillers: list[str] = []
    field_position: Position = "middle"
    context: list[str] = []
    record: list[tuple[str, str]] = []
    question: str = Field(min_length=1)
    options: list[str] = Field(min_length=2, max_length=2)
    expected_old: str
    expected_new: str
    template_id: str = "user"
    few_shot: list[Demo] = []
    cot: bool = False
    layout: Layout = "record"  # how the structured parts are laid out (kvprobe.datasets.layouts)
    field_style: FieldStyle = "key"  # record keys as written ("order_status") or in words ("order status")

    @model_validator(mode="after")
    def _consistent(self) -> EditCase:
        _check_value("field", self.field)
        _check_value("old_value", self.old_value)
        _check_value("new_value", self.new_value)
        if not self.rule and not self.prompt:
            raise ValueError("a case needs either a 'rule' (structured form) or a 'prompt' (free-form body)")
        if self.old_value == self.new_value:
            raise ValueError(f"old_value and new_value must differ (both {self.old_value!r})")
        if len(set(self.options)) != len(self.options):
            raise ValueError(f"options must be distinct, got {self.options}")
        for name in ("expected_old", "expected_new"):
            if getattr(self, name) not in self.options:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of options {self.options}")
        if self.control and self.expected_old != self.expected_new:
            raise ValueError("a control case must keep its answer (expected_old == expected_new)")
        if not self.control and self.expected_old == self.expected_new:
            raise ValueError("a non-control case must flip its answer (expected_old != expected_new)")
        if self.prompt is not None and (self.layout != "record" or self.field_style != "key"):
            raise ValueError("a free-form case (with 'prompt') has its own layout: leave 'layout' and 'field_style' "
                             "at their defaults")
        if any(key == self.field for key, _ in self.record):
            raise ValueError(f"record must not repeat the edited field {self.field!r}")
        return self
