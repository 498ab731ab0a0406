"""The memory set (:mod:`kvprobe.datasets.memory`) tokenized for one model: each part on its own (the
preamble holds BOS), and the profile with each fact value's token span, so that a context is
``preamble + parts... + question`` and the field-only repair knows which tokens a fact holds."""

from __future__ import annotations

from dataclasses import dataclass

from kvprobe.datasets.memory import (NEUTRAL, PROFILE, MemorySet, erratum_line, next_session_text, profile_lines,
                                     question_text, trajectory_text)
from kvprobe.datasets.skills import head_tail


@dataclass(frozen=True)
class ProfileTokens:
    """A profile tokenized line piece by line piece: ``ids`` and, per fact key, the [start, end) of
    its value's tokens within them."""

    ids: list[int]
    spans: dict[str, tuple[int, int]]


@dataclass(frozen=True)
class UserSegments:
    trajectory: list[int]
    next_session: list[int]
    profile: ProfileTokens
    profile_new: ProfileTokens  # after the edit
    erratum: list[int]


@dataclass(frozen=True)
class MemorySegments:
    """A set tokenized for one model; a context is ``preamble + parts... + question``."""

    form: str
    preamble: list[int]
    users: dict[str, UserSegments]
    questions: dict[str, list[int]]  # the question text plus the chat tail (or the raw answer cue)
    neutral: list[int]  # the neutral line (:data:`NEUTRAL`), placed where the erratum goes

    def context(self, user_id: str, layout: str, edited: bool = False) -> tuple[list[int], tuple[int, int]]:
        """The context ids before a question and where the profile lies in them ([start, end))."""
        u = self.users[user_id]
        profile = (u.profile_new if edited else u.profile).ids
        if layout == "early":
            return self.preamble + profile + u.trajectory, (len(self.preamble), len(self.preamble) + len(profile))
        start = len(self.preamble) + len(u.trajectory)
        return self.preamble + u.trajectory + profile, (start, start + len(profile))


def _profile_tokens(enc, profile) -> ProfileTokens:
    ids, spans = enc(f"{PROFILE}\n"), {}
    for (key, _), (label, value) in zip(profile, profile_lines(profile)):
        ids += enc(label)
        v = enc(value)
        spans[key] = (len(ids), len(ids) + len(v))
        ids += v + enc("\n")
    return ProfileTokens(ids + enc("\n"), spans)


def segments(data: MemorySet, tokenizer, form: str = "auto") -> MemorySegments:
    """Tokenize every part of ``data`` on its own (no special tokens added; the preamble holds BOS)."""
    resolved, head, tail = head_tail(tokenizer, data.system, form)

    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    users = {uid: UserSegments(enc(trajectory_text(u)), enc(next_session_text(u)), _profile_tokens(enc, u.profile),
                               _profile_tokens(enc, u.profile_after_edit()), enc(erratum_line(u)))
             for uid, u in data.users.items()}
    questions = {q.question_id: enc(question_text(q) + tail) for q in data.questions}
    return MemorySegments(resolved, enc(head), users, questions, enc(NEUTRAL + "\n\n"))
