"""The structured output of a request's sampling crosses the wire intact (and its absence)."""

from __future__ import annotations

import pytest

from helixserve.request import SamplingParams, StructuredOutput
from helixserve.runtime import transport as tp


@pytest.mark.parametrize("structured", [
    None,
    StructuredOutput("json_object", ""),
    StructuredOutput("json", '{"type": "object", "properties": {"é": {"type": "string"}}}'),
    StructuredOutput("regex", "[0-9]{3}"),
    StructuredOutput("choice", '["yes", "no"]'),
    StructuredOutput("lark", 'start: "a"+'),
])
def test_structured_round_trip(structured):
    params = SamplingParams(temperature=0.0, seed=3, structured=structured)
    msg = tp.sampling_to_pb(params)
    assert msg is not None
    back = tp.sampling_from_pb(type(msg).FromString(msg.SerializeToString()))
    assert back == params and back.structured == structured
