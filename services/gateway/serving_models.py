"""/v1/models: the one model this gateway serves (under its name and any aliases, TIDE_MODEL_ALIASES), and
the check every request's `model` goes through. Responses name the served model whichever name the request
used (as OpenAI answers an alias with the model it resolved to)."""

from __future__ import annotations

import time

from services.gateway.errors import model_not_found
from services.gateway.protocol import ModelCard, ModelList


class OpenAIServingModels:
    """The served model: its public name, what it is (root) and its context length."""

    def __init__(self, name: str, root: str, max_model_len: int, aliases: tuple[str, ...] = ()) -> None:
        self.name = name
        self.aliases = tuple(a for a in aliases if a != name)
        self.root = root
        self.max_model_len = max_model_len
        self.created = int(time.time())

    def check(self, model: str) -> None:
        """Raise the OpenAI 404 unless `model` is the served model's name or one of its aliases."""
        if model != self.name and model not in self.aliases:
            raise model_not_found(model)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def card(self, name: str | None = None) -> ModelCard:
        return ModelCard(id=name or self.name, created=self.created, root=self.root, max_model_len=self.max_model_len)

    def list_models(self) -> ModelList:
        return ModelList(data=[self.card(n) for n in self.names])

    def retrieve(self, model: str) -> ModelCard:
        self.check(model)
        return self.card(model)
