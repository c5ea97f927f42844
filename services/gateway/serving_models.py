"""/v1/models: the one model this gateway serves, and the check every request's `model` goes through."""

from __future__ import annotations

import time

from services.gateway.errors import model_not_found
from services.gateway.protocol import ModelCard, ModelList


class OpenAIServingModels:
    """The served model: its public name, what it is (root) and its context length."""

    def __init__(self, name: str, root: str, max_model_len: int) -> None:
        self.name = name
        self.root = root
        self.max_model_len = max_model_len
        self.created = int(time.time())

    def check(self, model: str) -> None:
        """Raise the OpenAI 404 unless `model` is the served model's name."""
        if model != self.name:
            raise model_not_found(model)

    def card(self) -> ModelCard:
        return ModelCard(id=self.name, created=self.created, root=self.root, max_model_len=self.max_model_len)

    def list_models(self) -> ModelList:
        return ModelList(data=[self.card()])

    def retrieve(self, model: str) -> ModelCard:
        self.check(model)
        return self.card()
