"""The long-conversation memory set: per user a profile of facts, a multi-session dialogue
trajectory, a planned edit of one fact, and yes/no questions whose answers need the profile.

A **user** has:

- a **profile**: ``## User profile`` and one ``{label}: {value}`` line per fact, the current
  values, drawn from the small closed vocabularies of :data:`FACTS`;
- a **trajectory**: ``sessions`` sessions (``## Session k``) of ``User:`` / ``Assistant:`` turns of
  filler about unrelated topics (:data:`FILLER`), with, at seeded places, remarks that a fact changed
  over time (``User: Quick update: my home city is no longer Berlin, that changed in May.``). A remark
  names an *earlier* value only, never the current one, and never a value a question asks about: the
  current value is in the profile alone;
- a **next session**: one more session of filler (no remarks), the trajectory of the context the
  profile is transplanted into;
- an **edit**: one fact whose value changes to another value of its vocabulary (of the same token
  length under the tokenizer where one exists, so the field-only repair replaces tokens one for one);
  with a tokenizer, only values it spells without an unknown token are used (:func:`usable_facts`:
  the word-level toys know few of them);
- **questions**, in the house's decision format (``Answer yes or no.``; the decision is the arg-max
  of the options' first-token logits), ``questions_per_user`` of them, of three kinds:

  ``edited``    on the edited fact, asking about its old or its new value (in turn): the expected
                answer flips with the edit (``expected_old`` != ``expected_new``);
  ``other``     on another profile fact, asking about its value or another of its vocabulary: the
                edit leaves the answer as it is;
  ``negative``  on a fact the profile does not hold (:data:`NEGATIVE_FACTS`, named nowhere in the
                user's text): nothing decides it, ``expected_old`` = ``expected_new`` = ``""``; its
                decision must not change when a fact is edited (the control).

Lengths are in tokens of the target model's tokenizer (words of the word-level tokenizer when none is
given): each session's filler is drawn up to a length drawn in ``session_tokens``. Everything is
drawn from ``random.Random`` seeded by the arguments and the user's id, so the same arguments and
tokenizer give the same set.

Layouts (:data:`LAYOUTS`): ``early`` is preamble, profile, trajectory, question; ``late`` is preamble,
trajectory, profile, question. :func:`kvprobe.datasets.memory_tokens.segments` tokenizes each part on
its own (the preamble holds BOS or the chat head with the system line; the question holds the chat
tail or the raw ``Answer:`` cue), with the profile cut at each value, so a value's token positions
are known in every layout.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from kvprobe.datasets.domains import OPTIONS
from kvprobe.datasets.generate import erratum_text
from kvprobe.datasets.render import ANSWER_WITH
from kvprobe.datasets.skills import _counter
from kvprobe.datasets.words import words
from kvprobe.errors import UsageError

SYSTEM = "You are an assistant with a memory of the user. Answer from the user profile."
PROFILE = "## User profile"
QUESTION = "## Question"
# An appended line that says nothing about any fact: the control for the erratum (some models answer
# differently after any appended text; PITFALLS.md)
NEUTRAL = "[NOTE] The conversation continues below."
LAYOUTS = ("early", "late")
KINDS = ("edited", "other", "negative")
MAX_SESSION_TOKENS = 8192
MONTHS = ("January", "March", "May", "July", "September", "November")


@dataclass(frozen=True)
class Fact:
    key: str
    label: str  # how the profile line and the erratum name it
    values: tuple[str, ...]
    question: str  # a yes/no question about one value: "{v}"
    remark: str  # a trajectory remark that an earlier value no longer holds: "{v}", "{month}"


FACTS = (
    Fact("city", "home city", ("Berlin", "Madrid", "Paris", "Lyon", "Oslo"), "Does the user live in {v}?",
         "I moved away from {v} in {month}, so that is no longer my home."),
    Fact("seat", "seat preference", ("aisle", "window", "middle"), "Does the user prefer a {v} seat?",
         "I used to always pick the {v} seat, but I stopped doing that in {month}."),
    Fact("cabin", "travel class", ("economy", "business", "first"), "Does the user fly {v} class?",
         "I flew {v} class for years, until {month}."),
    Fact("plan", "subscription plan", ("basic", "gold", "premium"), "Is the user on the {v} plan?",
         "I was on the {v} plan before {month}; I changed it."),
    Fact("device", "main device", ("laptop", "phone", "tablet"), "Does the user mostly use a {v}?",
         "My {v} broke in {month}, so I hardly use it any more."),
    Fact("diet", "diet", ("vegetarian", "vegan", "omnivore"), "Is the user {v}?",
         "I was {v} until {month}, but that changed."),
    Fact("pet", "pet", ("cat", "dog", "rabbit"), "Does the user have a {v}?",
         "Our {v} went to live with my parents in {month}."),
    Fact("region", "home region", ("EU", "UK", "US", "Asia"), "Does the user live in the {v} region?",
         "I lived in the {v} region until {month}."),
    Fact("team", "team", ("engineering", "support", "billing"), "Does the user work in {v}?",
         "I moved out of {v} in {month}."),
    Fact("airline", "preferred airline", ("Lufthansa", "Iberia", "KLM", "Finnair"),
         "Does the user prefer to fly with {v}?", "I stopped flying with {v} in {month}."),
    Fact("employer", "employer", ("Siemens", "Nokia", "Airbus", "Philips"), "Does the user work for {v}?",
         "I left {v} in {month}."),
)
NEGATIVE_FACTS = (
    Fact("colour", "favourite colour", ("red", "green", "blue"), "Is the user's favourite colour {v}?", ""),
    Fact("sport", "favourite sport", ("tennis", "football", "rowing"), "Is the user's favourite sport {v}?", ""),
    Fact("car", "car", ("Volvo", "Fiat", "Toyota"), "Does the user drive a {v}?", ""),
    Fact("music", "favourite music", ("jazz", "opera", "techno"), "Does the user listen to {v}?", ""),
)
FACT_BY_KEY = {f.key: f for f in FACTS + NEGATIVE_FACTS}

# Filler turns about topics no fact or negative question touches (a test checks no value or label occurs).
FILLER = (
    ("Can you suggest a simple soup for a cold evening?",
     "A lentil soup with carrots and cumin is quick and warming."),
    ("How long should I boil an egg for a soft yolk?", "About six minutes from boiling, then cool it in water."),
    ("What is a good way to remember names at meetings?",
     "Repeat the name once when you hear it and link it to something about the person."),
    ("Any tips for keeping houseplants alive?", "Water when the top of the soil is dry and give them indirect light."),
    ("Can you explain what a leap year is?", "A year with one extra day, added to keep the calendar with the seasons."),
    ("I need a short birthday message for a colleague.",
     "Happy birthday! Wishing you a year of good work and good rest."),
    ("How do I stop my glasses from fogging up?", "A drop of dish soap rubbed on the lenses and wiped dry helps."),
    ("What is the difference between weather and climate?",
     "Weather is the state of the air today; climate is its pattern over many years."),
    ("Could you summarise the plot of a heist film in one line?",
     "A crew plans one last job, and the plan goes wrong in a clever way."),
    ("How many minutes should I study before a break?", "Many people work for about twenty five minutes, then rest."),
    ("What makes bread rise?", "Yeast eats sugar and makes gas, which the dough traps."),
    ("Is it better to stretch before or after running?",
     "A light warm up before and gentle stretching after is a common advice."),
    ("Give me a word that rhymes with orange.", "Almost nothing rhymes with it; door hinge is the usual joke."),
    ("How do I write a polite reminder email?",
     "Thank them, mention the request and the date, and offer help if needed."),
    ("What is a good name for a chess club?", "Something short, like The Open Files or Knight Shift."),
    ("How can I learn a few words of a new language quickly?",
     "Label things at home with their names and say them aloud each day."),
    ("Can you help me plan a tidy desk?", "Keep only what you use daily on it and give every cable a clip."),
    ("How do I fold a fitted sheet?", "Tuck the corners into each other, then fold it like a flat sheet."),
)


@dataclass(frozen=True)
class MemoryUser:
    user_id: str
    profile: tuple[tuple[str, str], ...]  # (fact key, current value), in profile order
    sessions: tuple[tuple[tuple[str, str], ...], ...]  # per session: (role, text) turns
    next_session: tuple[tuple[str, str], ...]  # the session the profile is transplanted into
    remarks: tuple[tuple[str, str], ...]  # (fact key, earlier value) named by the trajectory
    edit_key: str
    edit_new: str

    @property
    def values(self) -> dict[str, str]:
        return dict(self.profile)

    @property
    def edit_old(self) -> str:
        return self.values[self.edit_key]

    def profile_after_edit(self) -> tuple[tuple[str, str], ...]:
        return tuple((k, self.edit_new if k == self.edit_key else v) for k, v in self.profile)


@dataclass(frozen=True)
class MemoryQuestion:
    question_id: str
    user_id: str
    kind: str  # one of KINDS
    fact: str  # the fact key the question is about
    asked: str  # the value it asks about
    text: str  # the question, with "Answer yes or no."
    expected_old: str  # under the current profile ("" for a negative question: nothing decides it)
    expected_new: str  # after the user's edit


@dataclass(frozen=True)
class MemorySet:
    system: str
    options: tuple[str, str]
    users: dict[str, MemoryUser]
    questions: list[MemoryQuestion]


# -- text ----------------------------------------------------------------------------------------
def profile_lines(profile) -> list[tuple[str, str]]:
    """``(label + ":", " " + value)`` per fact: the line is their concatenation."""
    return [(f"{FACT_BY_KEY[k].label}:", f" {v}") for k, v in profile]


def profile_text(profile) -> str:
    return f"{PROFILE}\n" + "".join(f"{a}{b}\n" for a, b in profile_lines(profile)) + "\n"


def session_text(turns, k: int | None) -> str:
    head = f"## Session {k}\n" if k is not None else "## Current session\n"
    return head + "".join(f"{role}: {text}\n" for role, text in turns) + "\n"


def trajectory_text(user: MemoryUser) -> str:
    return "".join(session_text(s, k + 1) for k, s in enumerate(user.sessions))


def next_session_text(user: MemoryUser) -> str:
    return session_text(user.next_session, None)


def question_text(q: MemoryQuestion) -> str:
    return f"{QUESTION}\n{q.text}"


def erratum_line(user: MemoryUser) -> str:
    """The correction line of the erratum arm (the house's paper template), ending a paragraph."""
    return erratum_text(FACT_BY_KEY[user.edit_key].label, user.edit_new) + "\n\n"


def render(data: MemorySet, q: MemoryQuestion, layout: str = "late", edited: bool = False) -> str:
    """The body text of one question's context (inside the chat turn, or after the system line)."""
    user = data.users[q.user_id]
    profile = profile_text(user.profile_after_edit() if edited else user.profile)
    parts = [profile, trajectory_text(user)] if layout == "early" else [trajectory_text(user), profile]
    return "".join(parts) + question_text(q)


# -- the set -------------------------------------------------------------------------------------
def check_options(n: int, sessions: int, session_tokens: tuple[int, int], questions_per_user: int) -> None:
    """One-line usage errors for a memory set's options, before any work."""
    if n < 1:
        raise UsageError(f"n must be >= 1, got {n}")
    if not 1 <= sessions <= 32:
        raise UsageError(f"sessions must be in 1..32, got {sessions}")
    lo, hi = session_tokens
    if not 32 <= lo <= hi <= MAX_SESSION_TOKENS:
        raise UsageError(f"session_tokens is a (min, max) length with 32 <= min <= max <= {MAX_SESSION_TOKENS}, "
                         f"got {tuple(session_tokens)}")
    if not 3 <= questions_per_user <= 12:
        raise UsageError(f"questions_per_user must be in 3..12 (one of each kind at least), got {questions_per_user}")


def _session(rng: random.Random, target: int, count, fixed: list[str]) -> tuple[tuple[str, str], ...]:
    """Filler turns in shuffled rounds up to about ``target`` tokens, each ``fixed`` user remark
    (with an acknowledgement) at a seeded place."""
    turns: list[tuple[str, str]] = []
    budget = target - sum(count(f"User: {r}") + count("Assistant: Thanks, noted.") for r in fixed)
    while budget > 0:
        pool = list(FILLER)
        rng.shuffle(pool)
        for ask, answer in pool:
            if budget <= 0:
                break
            turns += [("User", ask), ("Assistant", answer)]
            budget -= count(f"User: {ask}") + count(f"Assistant: {answer}")
    for remark in fixed:
        at = 2 * rng.randint(0, len(turns) // 2)
        turns[at:at] = [("User", remark), ("Assistant", "Thanks, noted.")]
    return tuple(turns)


def _value_length(tokenizer, value: str) -> int:
    """Tokens of the profile's value piece (``" " + value``)."""
    if tokenizer is None:
        return len(words(value))
    return len(tokenizer.encode(f" {value}", add_special_tokens=False))


def usable_facts(tokenizer) -> list[Fact]:
    """The facts whose values the tokenizer spells (no unknown token), each with only those values,
    keeping the facts with three or more (an old, a new and an earlier value). A word-level toy
    tokenizer knows few of the values; a real model's knows them all."""
    unk = getattr(tokenizer, "unk_token_id", None) if tokenizer is not None else None
    out = []
    for f in FACTS:
        values = tuple(v for v in f.values if unk is None
                       or unk not in tokenizer.encode(f" {v}", add_special_tokens=False))
        if len(values) >= 3:
            out.append(dataclasses.replace(f, values=values))
    return out


def fact_pool(tokenizer, n_facts: int) -> list[Fact]:
    """:func:`usable_facts`, checked to hold ``n_facts`` of them (a one-line usage error otherwise)."""
    pool = usable_facts(tokenizer)
    if not 2 <= n_facts <= len(pool):
        raise UsageError(f"n_facts must be in 2..{len(pool)} (the facts whose values this tokenizer spells), "
                         f"got {n_facts}")
    return pool


def _user(uid: str, seed: int, tokenizer, sessions: int, session_tokens: tuple[int, int], n_facts: int,
          pool: list[Fact]):
    rng = random.Random(f"memory:{seed}:{uid}")
    count = _counter(tokenizer)
    facts = rng.sample(pool, n_facts)
    profile = tuple((f.key, rng.choice(f.values)) for f in facts)
    values = dict(profile)
    edit = rng.choice(facts)
    old = values[edit.key]
    others = [v for v in edit.values if v != old]
    same = [v for v in others if _value_length(tokenizer, v) == _value_length(tokenizer, old)]
    new = rng.choice(same or others)  # a value of the same token length where the vocabulary has one
    # remarks: earlier values of about half the facts, never the current value nor the edit's new value
    remarks = []
    for f in facts:
        earlier = [v for v in f.values if v != values[f.key] and not (f is edit and v == new)]
        if rng.random() < 0.5 and earlier:
            remarks.append((f.key, rng.choice(earlier)))
    placed: list[list[str]] = [[] for _ in range(sessions)]
    for key, v in remarks:
        placed[rng.randrange(sessions)].append("Quick update: " + FACT_BY_KEY[key].remark.format(
            v=v, month=rng.choice(MONTHS)))
    trajectory = tuple(_session(rng, rng.randint(*session_tokens), count, placed[k]) for k in range(sessions))
    nxt = _session(rng, rng.randint(*session_tokens), count, [])
    user = MemoryUser(uid, profile, trajectory, nxt, tuple(remarks), edit.key, new)
    return user, rng


def _questions(user: MemoryUser, rng: random.Random, k: int, start: int, seed: int,
               pool: dict[str, Fact], prefix: str = "mem") -> list[MemoryQuestion]:
    values, remarked = user.values, {(key, v) for key, v in user.remarks}
    kinds = ["edited", "other", "negative"] + [KINDS[i % 3] for i in range(k - 3)]
    out = []
    for j, kind in enumerate(kinds):
        if kind == "edited":
            fact = pool[user.edit_key]
            asked = (user.edit_old, user.edit_new)[sum(x == "edited" for x in kinds[:j]) % 2]
            old = OPTIONS[0] if asked == user.edit_old else OPTIONS[1]
            new = OPTIONS[0] if asked == user.edit_new else OPTIONS[1]
        elif kind == "other":
            fact = pool[rng.choice([key for key in values if key != user.edit_key])]
            wrong = [v for v in fact.values if v != values[fact.key] and (fact.key, v) not in remarked]
            asked = values[fact.key] if rng.random() < 0.5 or not wrong else rng.choice(wrong)
            old = new = OPTIONS[0] if asked == values[fact.key] else OPTIONS[1]
        else:
            fact = rng.choice(NEGATIVE_FACTS)
            asked, old, new = rng.choice(fact.values), "", ""
        text = f"{fact.question.format(v=asked)} {ANSWER_WITH.format(a=OPTIONS[0], b=OPTIONS[1])}"
        out.append(MemoryQuestion(f"{prefix}-s{seed}-{start + j:05d}-{kind}", user.user_id, kind, fact.key, asked, text,
                                  old, new))
    return out


def generate_memory(n: int, seed: int = 0, tokenizer=None, sessions: int = 3,
                    session_tokens: tuple[int, int] = (120, 200), questions_per_user: int = 4,
                    n_facts: int = 6) -> MemorySet:
    """``n`` questions over ``ceil(n / questions_per_user)`` users (see the module docstring)."""
    session_tokens = tuple(session_tokens)
    check_options(n, sessions, session_tokens, questions_per_user)
    pool = fact_pool(tokenizer, n_facts)
    users: dict[str, MemoryUser] = {}
    questions: list[MemoryQuestion] = []
    u = 0
    while len(questions) < n:
        user, rng = _user(f"user-s{seed}-{u:04d}", seed, tokenizer, sessions, session_tokens, n_facts, pool)
        users[user.user_id] = user
        questions += _questions(user, rng, questions_per_user, len(questions), seed, {f.key: f for f in pool})
        u += 1
    questions = questions[:n]
    return MemorySet(SYSTEM, OPTIONS, {k: v for k, v in users.items() if any(q.user_id == k for q in questions)},
                     questions)


def calibration_memory(n_users: int, seed: int = 0, tokenizer=None, sessions: int = 3,
                       session_tokens: tuple[int, int] = (120, 200), n_facts: int = 6) -> MemorySet:
    """The per-field policy's calibration split: ``n_users`` users drawn apart from the evaluation's
    (ids ``cal-s{seed}-NNNN``, never an evaluation user's), each edited on every fact of its profile
    in turn. One *element* per (user, fact): a user ``cal-s{seed}-NNNN:{fact}`` with the base user's
    profile, trajectory and remarks, that fact's edit (to a value of the same token length where the
    vocabulary has one, never a value the trajectory's remarks name) and four questions: edited (its
    old value), other, negative, edited (its new value). Elements of one base user share its late
    context (the profile is the current one until the edit), so its cache is built once."""
    session_tokens = tuple(session_tokens)
    check_options(n_users, sessions, session_tokens, 4)
    pool = fact_pool(tokenizer, n_facts)
    by_key = {f.key: f for f in pool}
    users: dict[str, MemoryUser] = {}
    questions: list[MemoryQuestion] = []
    for u in range(n_users):
        base, rng = _user(f"cal-s{seed}-{u:04d}", seed, tokenizer, sessions, session_tokens, n_facts, pool)
        remarked = {(key, v) for key, v in base.remarks}
        for key, old in base.profile:
            others = [v for v in by_key[key].values if v != old and (key, v) not in remarked]
            others = others or [v for v in by_key[key].values if v != old]
            same = [v for v in others if _value_length(tokenizer, v) == _value_length(tokenizer, old)]
            element = dataclasses.replace(base, user_id=f"{base.user_id}:{key}", edit_key=key,
                                          edit_new=rng.choice(same or others))
            users[element.user_id] = element
            questions += _questions(element, rng, 4, len(questions), seed, by_key, prefix="cal")
    return MemorySet(SYSTEM, OPTIONS, users, questions)
