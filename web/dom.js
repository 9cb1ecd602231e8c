// What the status page and the trajectory viewer share: DOM and SVG nodes (text is only
// ever set with textContent, never parsed as HTML) and the formats of numbers and times.
"use strict";

window.RG = (() => {
  const SVG_NS = "http://www.w3.org/2000/svg";
  function el(tag, attrs = {}, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function svg(tag, attrs = {}, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function num(n, digits = 1) {
    if (n === null || n === undefined || Number.isNaN(n)) return "–";
    const a = Math.abs(n);
    if (a >= 1e9) return (n / 1e9).toFixed(digits) + "G";
    if (a >= 1e6) return (n / 1e6).toFixed(digits) + "M";
    if (a >= 1e4) return (n / 1e3).toFixed(digits) + "k";
    if (a >= 100 || Number.isInteger(n)) return Math.round(n).toLocaleString("en-US");
    return n.toFixed(digits);
  }
  function dur(s) {
    if (s === null || s === undefined) return "–";
    if (s < 1) return Math.round(s * 1000) + " ms";
    if (s < 60) return s.toFixed(s < 10 ? 2 : 1) + " s";
    if (s < 3600) return Math.floor(s / 60) + "m " + String(Math.round(s % 60)).padStart(2, "0") + "s";
    return Math.floor(s / 3600) + "h " + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
  }
  function niceStep(span, ticks) {
    const raw = span / Math.max(1, ticks);
    const mag = Math.pow(10, Math.floor(Math.log10(raw || 1)));
    const norm = raw / mag;
    return (norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10) * mag;
  }
  return { el, svg, num, dur, niceStep };
})();
