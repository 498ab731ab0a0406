"""A model's identity: what kvprobe checks before a file computed with one model is used with another.

A model is known by its content, not by the spec or path that named it: the hash of its config, of
its weights and of its tokenizer (vocabulary and chat template), and its family
(:meth:`kvprobe.models.load.LoadedModel.fingerprint` computes them). Every file that holds results or a
decision for one model records this identity, and every reader checks it with :meth:`ModelIdentity.differ`:

- a results folder's ``inputs.json`` (:func:`kvprobe.results.claim_inputs`, on every resume);
- a policy, ``topk.yaml`` (:mod:`kvprobe.policy`) and ``field_policy.yaml`` (:mod:`kvprobe.field_policy`);
- a precompiled block (:mod:`kvprobe.composer.store`);
- each Ray worker's model against the driver's (:mod:`kvprobe.executor.ray_workers`).

Each reader words its own refusal (what to do differs: export a policy again, precompile a block
again, put the same files on every node); the keys and the comparison are the ones here. Standard
library only, so the lowest layers (results, policies) can import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

HASHES = {"config_hash": "config", "weights_hash": "weights", "tokenizer_hash": "tokenizer"}  # key: what it hashes
KEYS = ("family", *HASHES)  # the identity's content: what a file records beside the spec that named the model


@dataclass(frozen=True)
class ModelIdentity:
    """``spec`` names the model (a bundled alias, a path); the other four fields identify it."""

    spec: str
    family: str
    config_hash: str
    weights_hash: str
    tokenizer_hash: str

    @classmethod
    def of(cls, record: Mapping) -> ModelIdentity:
        """From a record that holds ``spec`` and :data:`KEYS` (a fingerprint, a file's ``model``)."""
        return cls(**{k: record[k] for k in ("spec", *KEYS)})

    @classmethod
    def of_model(cls, lm) -> ModelIdentity:
        """A loaded model's (anything with ``fingerprint()``, as :class:`~kvprobe.models.load.LoadedModel`)."""
        return cls.of(lm.fingerprint())

    def as_dict(self) -> dict:
        """``spec`` then :data:`KEYS`, the order every file writes."""
        return asdict(self)

    def content(self) -> dict:
        """:data:`KEYS` only: what two loads of the same files share whatever path named them."""
        return {k: getattr(self, k) for k in KEYS}

    def differ(self, stored: Mapping, keys=KEYS) -> list[str]:
        """The keys (of ``keys``, in that order) whose value in ``stored`` is not this model's; [] when it is
        this model. A key missing from ``stored`` differs."""
        return [k for k in keys if stored.get(k) != getattr(self, k)]


def malformed(record, keys=KEYS) -> list[str]:
    """The keys of ``keys`` that ``record`` (a file's ``model``) lacks or holds as other than a string."""
    return [k for k in keys if not isinstance(record, Mapping) or not isinstance(record.get(k), str)]
