"""Which requests constrain sampling (gateway/proxy/constraints.py): forced tool calls and
structured output do; free sampling, "auto" and "none" do not."""

from __future__ import annotations

import pytest

from gateway.proxy.constraints import constraint_of

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


@pytest.mark.parametrize(("body", "kind"), [
    ({"messages": []}, None),
    ({"tools": TOOLS, "tool_choice": "auto"}, None),
    ({"tools": TOOLS, "tool_choice": "none"}, None),
    ({"tools": TOOLS}, None),
    ({"tool_choice": "required"}, None),  # no tools: nothing to force
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "json_schema"),
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "text"}}, None),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "json_schema"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
    ({"structured_outputs": {}}, None),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
])
def test_constraint_of(body: dict, kind: str | None) -> None:
    assert constraint_of(body) == kind
