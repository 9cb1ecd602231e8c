"""Token capture: inject ``return_token_ids`` / ``logprobs`` upstream, collect, strip.

Every upstream call asks vLLM for the prompt and completion token ids and the sampled
tokens' logprobs. What the client did not ask for is removed from the answer before it
is relayed, so an unmodified harness sees exactly the response shape it expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

INJECTED_KEYS = ("token_ids", "prompt_token_ids")
#: the request field of vLLM's routed experts (``--enable-return-routed-experts``): the
#: first position whose routes the answer carries (:mod:`gateway.proxy.routes`)
ROUTES_START = "routed_experts_prompt_start"


@dataclass(frozen=True, slots=True)
class ClientAsked:
    """What the client itself requested (so the relay knows what to strip)."""

    token_ids: bool
    logprobs: bool
    usage: bool = True  # a streamed call's usage chunk (``stream_options.include_usage``)
    #: the client chose the first position of the routed experts itself: they are its
    routes: bool = False


def inject(body: dict[str, Any], *, chat: bool) -> ClientAsked:
    """Turn token capture on in ``body`` (in place); report what the client asked for."""
    asked_ids = body.get("return_token_ids") is True
    raw_lp = body.get("logprobs")
    if chat:
        asked_lp = raw_lp is True
        if not asked_lp:
            body["logprobs"] = True
            body["top_logprobs"] = 0
    else:
        # vLLM coerces ``logprobs: true`` to 1 on /v1/completions: that is a request too.
        asked_lp = raw_lp is True or (isinstance(raw_lp, int) and raw_lp >= 0)
        if not asked_lp:
            body["logprobs"] = 0
    body["return_token_ids"] = True
    asked_usage = True
    if body.get("stream") is True:  # without it a streamed call's usage is never seen
        options = body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        asked_usage = options.get("include_usage") is True
        if not asked_usage:
            body["stream_options"] = {**options, "include_usage": True}
    return ClientAsked(token_ids=asked_ids, logprobs=asked_lp, usage=asked_usage,
                       routes=ROUTES_START in body)


@dataclass(slots=True)
class ChoiceCapture:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    #: routed experts, one ``[first position, vLLM's base64 .npy]`` per upstream answer
    #: that carried them (a call continued across a weight update has several)
    routes: list[list[Any]] = field(default_factory=list)


@dataclass(slots=True)
class Capture:
    """Accumulates what one call produced, from a full response or from stream chunks."""

    chat: bool
    asked: ClientAsked
    prompt_ids: list[int] | None = None
    choices: dict[int, ChoiceCapture] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    chunks: int = 0
    fast: int = 0  # of ``chunks``, those captured by the fast path (gateway.proxy.token_runs)
    #: the first position the routes of the answer being read start at (the request's
    #: ``routed_experts_prompt_start``)
    routes_start: int = 0

    def choice(self, index: int) -> ChoiceCapture:
        cap = self.choices.get(index)
        if cap is None:
            cap = self.choices[index] = ChoiceCapture()
        return cap

    def generated_all(self) -> bool:
        """Whether the engine finished every choice (a weight-update ``abort`` is not done:
        the call is continued), so the record is whole whatever the client does next."""
        return bool(self.choices) and all(
            c.finish_reason not in (None, "abort") for c in self.choices.values())

    def feed(self, payload: dict[str, Any], *, stream: bool) -> bool:
        """Record ``payload`` and strip it in place; True if it was modified.

        Runs once per streamed token event, so it looks each key up once and touches
        only the keys that are there. A payload left empty is not to be relayed."""
        self.chunks += 1
        modified = False
        if "prompt_token_ids" in payload:
            modified = self._take_prompt(payload)
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
            if stream and not self.asked.usage and not payload.get("choices"):
                payload.clear()  # the usage chunk the client did not ask for: not relayed
                return True
        for ch in payload.get("choices") or ():
            if isinstance(ch, dict) and self._feed_choice(ch, stream=stream):
                modified = True
        return modified

    def _take_prompt(self, obj: dict[str, Any]) -> bool:
        """Keep the first prompt ids seen; strip them unless asked. True if stripped."""
        prompt = obj["prompt_token_ids"]
        if isinstance(prompt, list) and self.prompt_ids is None:
            self.prompt_ids = prompt
        if self.asked.token_ids:
            return False
        del obj["prompt_token_ids"]
        return True

    def _feed_choice(self, ch: dict[str, Any], *, stream: bool) -> bool:
        index = ch.get("index", 0)
        cap = self.choice(index if type(index) is int else int(index))
        modified = False
        ids = ch.get("token_ids")
        if isinstance(ids, list):
            cap.token_ids.extend(ids)
        if "token_ids" in ch and not self.asked.token_ids:
            del ch["token_ids"]
            modified = True
        if "prompt_token_ids" in ch and self._take_prompt(ch):
            modified = True
        routes = ch.get("routed_experts")  # non-streamed answers only (streams carry none)
        if isinstance(routes, str) and routes:
            cap.routes.append([self.routes_start, routes])
            if not self.asked.routes:
                del ch["routed_experts"]
                modified = True
        lp = ch.get("logprobs")
        if isinstance(lp, dict):
            _collect_logprobs(lp, cap.logprobs, chat=self.chat)
            if not self.asked.logprobs:
                ch["logprobs"] = None
                modified = True
        reason = ch.get("finish_reason")
        if reason:
            cap.finish_reason = reason
        if self.chat:
            msg = ch.get("delta" if stream else "message")
            if isinstance(msg, dict):
                _collect_message(msg, cap)
        else:
            text = ch.get("text")
            if isinstance(text, str):
                cap.text.append(text)
        return modified

    def completion(self, index: int = 0) -> ChoiceCapture:
        return self.choices.get(index) or ChoiceCapture()


def _collect_logprobs(lp: dict[str, Any], out: list[float], *, chat: bool) -> None:
    if chat:
        for item in lp.get("content") or ():
            if isinstance(item, dict):
                out.append(float(item.get("logprob", 0.0)))
        return
    for value in lp.get("token_logprobs") or ():
        out.append(float(value) if value is not None else 0.0)


def _collect_message(msg: dict[str, Any], cap: ChoiceCapture) -> None:
    content = msg.get("content")
    if isinstance(content, str):
        cap.text.append(content)
    for call in msg.get("tool_calls") or ():
        if isinstance(call, dict):
            merge_tool_call(cap.tool_calls, call)


def merge_tool_call(acc: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    idx = int(delta.get("index", len(acc)))
    cur = acc.setdefault(idx, {"id": None, "type": "function", "function": {"name": "",
                                                                           "arguments": ""}})
    if delta.get("id"):
        cur["id"] = delta["id"]
    fn = delta.get("function")
    if isinstance(fn, dict):
        if fn.get("name"):
            cur["function"]["name"] += fn["name"]
        if isinstance(fn.get("arguments"), str):
            cur["function"]["arguments"] += fn["arguments"]
