"""docs/configuration.md must be exactly what the settings models generate, and it must document
exactly the variables the services' `from_env` read."""

from __future__ import annotations

import re

from launcher.envkeys import RecordingEnv

from tools import gen_config_docs


def test_committed_docs_match_the_models() -> None:
    hint = "docs/configuration.md is stale: run `python -m tools.gen_config_docs` and commit it"
    assert gen_config_docs.OUTPUT.read_text() == gen_config_docs.render(), hint


def test_the_docs_name_the_variables_from_env_reads() -> None:
    read: set[str] = set()
    for _, _, model, _ in gen_config_docs.SECTIONS:
        env = RecordingEnv()
        model.from_env(env)
        read |= env.asked
    documented = set(re.findall(r"`(TIDE_[A-Z0-9_]+)`", gen_config_docs.render()))
    assert documented == read, (sorted(documented - read), sorted(read - documented))
