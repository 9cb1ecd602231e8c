"""Whether a call's sampling was constrained, read from its request.

A forced tool call (``tool_choice`` ``"required"`` or a named function, with tools) and
structured output (``response_format`` ``json_schema`` / ``json_object``, the Responses
API's ``text.format``, vLLM's ``structured_outputs`` and older ``guided_*`` fields) make
the engine sample from a distribution masked to what the grammar allows, and report the
logprobs of that masked distribution. The trainer's model, unmasked, gives the same
tokens a lower probability, so these calls' recorded logprobs are not the ones an
importance-sampling correction assumes (docs/training-mismatch.md). The record keeps the
kind, so a trainer can tell those tokens apart (``CallSpan.constrained``).
"""

from __future__ import annotations

from typing import Any

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED = ("json", "regex", "choice", "grammar", "structural_tag")


def constraint_of(body: dict[str, Any]) -> str | None:
    """The kind of constraint on the call's sampling, or None when it samples freely:
    ``tool_choice``, ``json_schema``, ``json_object``, ``structured_outputs``, or the
    ``guided_*`` field's name."""
    if body.get("tools") and _forced(body.get("tool_choice")):
        return "tool_choice"
    for fmt in (body.get("response_format"), _text_format(body.get("text"))):
        if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object"):
            return str(fmt["type"])
    structured = body.get("structured_outputs")
    if isinstance(structured, dict) and any(structured.get(k) is not None
                                            for k in _STRUCTURED):
        return "structured_outputs"
    return next((k for k in _GUIDED if body.get(k) is not None), None)


def _forced(choice: Any) -> bool:
    if choice == "required":
        return True
    # a named function: {"type": "function", "function": {"name": ...}} (chat) or
    # {"type": "function", "name": ...} (Responses)
    return isinstance(choice, dict) and choice.get("type") == "function"


def _text_format(text: Any) -> Any:
    return text.get("format") if isinstance(text, dict) else None
