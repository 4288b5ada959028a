"""CoordinatorConfig: bad values fail with the field and the value, before any connection."""

from __future__ import annotations

import pytest

from helixserve.errors import UserError
from helixserve.runtime import CoordinatorConfig


def test_defaults_pass() -> None:
    assert CoordinatorConfig().check().kv_allocation == "on-demand"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("kv_allocation", "lazy", "kv_allocation: bad value 'lazy'; known: reserve, on-demand"),
        ("kv_watermark", 1.0, "kv_watermark: bad value 1.0"),
        ("max_queue", -1, "max_queue: bad value -1"),
        ("prefill_chunk_tokens", 0, "prefill_chunk_tokens: bad value 0"),
        ("step_timeout_s", 0.0, "step_timeout_s: bad value 0.0"),
        ("hang_timeout_s", 0.0, "hang_timeout_s: bad value 0.0"),
        ("admission_timeout_s", -1.0, "admission_timeout_s: bad value -1.0"),
    ],
)
def test_bad_values_name_field_and_value(field: str, value: object, message: str) -> None:
    with pytest.raises(UserError, match=message):
        CoordinatorConfig(**{field: value}).check()  # type: ignore[arg-type]
