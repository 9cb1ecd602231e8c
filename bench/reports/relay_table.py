"""``rollout-gateway bench relay``'s table (``bench/runners/relay.py`` measures)."""

from __future__ import annotations

from typing import Any


def relay_markdown(doc: dict[str, Any]) -> str:
    ip = doc.get("in_process")
    lines: list[str] = []
    if ip:
        lines += [f"In process: the relay's decoder on a {ip['events']}-event stream of the "
                  "benchmark upstream (vLLM's wire format), best of "
                  f"{doc['options']['repeats']}, both paths alternating.", "",
                  "| events per upstream read | general path, us/event | fast path, us/event "
                  "| fast / general |", "|---|---|---|---|"]
        for k, r in ip["reads"].items():
            us = r["us_per_event"]
            lines.append(f"| {k} | {us['general']:.2f} | {us['fast']:.2f} | "
                         f"{r['ratio']:.2f}x |")
    e2e = doc.get("end_to_end")
    if e2e:
        short, long = doc["options"]["lengths"]
        sides = e2e.get("sides", ["fast", "general"])
        names = {"fast": "fast path", "general": "general path",
                 "baseline": f"`{doc['options'].get('baseline')}`",
                 "plain": "plain proxy",
                 "grouped": f"fast path, {doc['options'].get('stream_interval')} tokens an "
                 "event"}
        pace = doc["options"].get("interval_ms") or 0
        lines += ["", "End to end: one gateway process per side, traces on into Postgres, "
                  f"{doc['options']['concurrency']} streamed calls in flight, "
                  + (f"the upstream's events {pace:g} ms apart (about one per read)"
                     if pace else "each call's events sent at once (many per read)")
                  + (f"; the grouped side's upstream sends a call's tokens as vLLM's "
                     f"`--stream-interval {grouped}` does (the first alone, then {grouped} "
                     f"an event{f', {pace:g} ms a token' if pace else ''})"
                     if (grouped := doc["options"].get("stream_interval") or 1) > 1 else "")
                  + f"; the gateway's CPU per call at {short} and {long} output tokens, "
                  "per token = the slope between.", "",
                  "| round | " + " | ".join(f"{names[s]}, us/token" for s in sides) + " | "
                  + " | ".join(_ratio_name(names, s, "fast") for s in sides[1:]) + " |",
                  "|---|" + "---|" * (2 * len(sides) - 1)]
        for i, r in enumerate(e2e["rounds"], 1):
            lines.append(f"| {i} | " + " | ".join(f"{r[s]['us_per_token']:.2f}" for s in sides)
                         + " | " + " | ".join(f"{_ratio(r, s):.2f}x" for s in sides[1:])
                         + " |")
        for s in sides[1:]:
            agg = (e2e.get("grouped_vs_fast") if s == "grouped" else e2e.get(f"fast_vs_{s}")
                   ) or {"mean": e2e["ratio_mean"], "min": e2e["ratio_min"],
                         "max": e2e["ratio_max"]}
            lines += ["", f"Per-token CPU, {_ratio_name(names, s, 'fast path')}: mean "
                      f"{agg['mean']:.2f}x "
                      f"(rounds {agg['min']:.2f}x-{agg['max']:.2f}x)."]
        taken = e2e.get("relayed_events")
        if taken:
            lines += ["", "Events by the relay path that took them "
                      "(`rollout_gateway_relayed_events_total`, read after the run): "
                      + "; ".join(f"{names[s]}: " + (", ".join(
                          f"{n:.0f} {p}" for p, n in sorted(taken[s].items()))
                          or "no counter (it predates it)") for s in sides if s in taken)
                      + "."]
    return "\n".join([*lines, "", "```sh", doc["command"], "```"]).lstrip("\n")


def _ratio_name(names: dict[str, str], side: str, fast: str) -> str:
    """The grouped side is over the fast path (what grouping saves); the others under it."""
    return (f"{names[side]} / one token an event" if side == "grouped"
            else f"{fast} / {names[side]}")


def _ratio(row: dict[str, Any], side: str) -> float:
    if side == "grouped":
        return float(row["grouped_vs_fast"])
    value: float = row[f"fast_vs_{side}"] if f"fast_vs_{side}" in row else row["ratio"]
    return value
