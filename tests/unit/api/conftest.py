"""Fixtures: the real app over the fake coordinator, served by real uvicorn on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from api_testlib import API_KEY, FakeCoordinator, ServerThread

from helixserve.api.app import create_app


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from helixserve.engine import prepare_demo_model

    return AutoTokenizer.from_pretrained(prepare_demo_model())


@pytest.fixture(scope="module")
def fake(tokenizer: Any) -> FakeCoordinator:
    return FakeCoordinator(tokenizer)


@pytest.fixture(scope="module")
def server(fake: FakeCoordinator) -> Iterator[ServerThread]:
    with ServerThread(create_app(fake, None, api_key=API_KEY)) as s:
        yield s


@pytest.fixture()
def client(server: ServerThread) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
