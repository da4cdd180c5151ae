"""A step-through viewer of a :class:`~towers.trace.state.StateTrace`: one self-contained HTML page.

Keys: → / space next, ← previous, Home / End; ``#tick=3`` (``-1``: the inputs),
``&press=next`` and ``&key=ArrowLeft`` set the position. Tests read the DOM: ``<g
class="chunk" data-tower data-segment data-held>``, ``<g class="send" data-src data-dst
data-ranges>``, ``#status[data-tick]``.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any

from towers.trace.state import StateTrace, range_label, sends_by_tick, topology

__all__ = ["viewer_data", "write_html"]

_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf"]


def viewer_data(state: StateTrace) -> dict[str, Any]:
    """Everything the page draws, as JSON-ready data (``states[k]``: after tick ``k - 1``)."""
    topo = topology(state)
    return {
        "algorithm": state.trace.algorithm,
        "towers": state.towers,
        "segments": [list(s) for s in state.segments],
        "states": [[[sorted(h) for h in tower] for tower in k] for k in state.states],
        "sends": [[{"src": s, "dst": d, "ranges": range_label(r)}
                   for (t, s, d), r in sends_by_tick(state).items() if t == tick]
                  for tick in range(state.ticks)],
        "notes": [state.trace.note(t) for t in range(state.ticks)],
        "topology": {"kind": topo.kind, "positions": topo.positions, "links": topo.links},
        "observed": state.observed,
        "colours": [_COLOURS[i % len(_COLOURS)] for i in range(state.towers)],
    }


_PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 16px; color: #222; }
button { font-size: 14px; margin-right: 4px; }
#status { display: inline-block; margin-left: 12px; font-weight: bold; }
#help { color: #666; font-size: 12px; margin: 6px 0 10px; }
svg text { font: 11px system-ui, sans-serif; }
.link { stroke: #bbb; stroke-width: 1.5; }
.link.lit { stroke: #222; stroke-width: 3; }
</style></head><body>
<h2>__TITLE__</h2>
<div><button id="first">&#x23EE; first</button><button id="prev">&#x25C0; prev</button>
<button id="next">next &#x25B6;</button><button id="last">last &#x23ED;</button>
<span id="status" data-tick="-1"></span></div>
<div id="help">Keys: &rarr; or space: next, &larr;: previous, Home / End. Each chunk is a column
of squares, one per tower: a coloured square i means the chunk holds tower i's contribution.
Arrows: this tick's sends, labelled with the elements they carry.</div>
<svg id="view" xmlns="http://www.w3.org/2000/svg"></svg>
<script id="data" type="application/json">__DATA__</script>
<script>
const D = JSON.parse(document.getElementById('data').textContent);
const N = D.towers, T = D.states.length - 1, S = D.segments.length;
const NS = 'http://www.w3.org/2000/svg';
const ROW = 46, TOP = 30, LEFT = 330, LABEL = 70;
const CW = Math.max(8, Math.min(40, 560 / S)), SQ = (ROW - 10) / N;
const GRID_W = LABEL + S * CW + 20, ARROWS_X = LEFT + GRID_W;
let tick = -1;
function el(tag, attrs, parent, text) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  parent.appendChild(e); return e;
}
function rowY(p) { return TOP + p * ROW; }
function draw() {
  const svg = document.getElementById('view');
  svg.innerHTML = '';
  const sends = tick >= 0 ? D.sends[tick] : [];
  svg.setAttribute('width', ARROWS_X + 260);
  svg.setAttribute('height', Math.max(rowY(N) + 20, 330));
  const defs = el('defs', {}, svg);
  const m = el('marker', {id: 'head', viewBox: '0 0 10 10', refX: 9, refY: 5,
    markerWidth: 7, markerHeight: 7, orient: 'auto-start-reverse'}, defs);
  el('path', {d: 'M 0 0 L 10 5 L 0 10 z', fill: '#333'}, m);
  drawTopology(svg, sends);
  const state = D.states[tick + 1];
  for (let p = 0; p < N; p++) {
    el('text', {x: LEFT, y: rowY(p) + ROW / 2}, svg, 'tower ' + p);
    for (let s = 0; s < S; s++) {
      const held = state[p][s];
      const g = el('g', {'class': 'chunk', 'data-tower': p, 'data-segment': s,
                         'data-held': held.join(' ')}, svg);
      const x = LEFT + LABEL + s * CW;
      el('title', {}, g, 'tower ' + p + ', elements ' + D.segments[s][0] + ':' +
         D.segments[s][1] + ' holds ' + (held.length ? held.join(', ') : 'nothing'));
      for (let i = 0; i < N; i++) {
        el('rect', {x: x + 1, y: rowY(p) + 4 + i * SQ, width: CW - 2, height: SQ,
          fill: held.includes(i) ? D.colours[i] : '#eee', stroke: '#fff', 'stroke-width': 0.5}, g);
      }
    }
  }
  sends.forEach((s, k) => {
    const x = ARROWS_X + 14 * (k % 12), y0 = rowY(s.src) + ROW / 2, y1 = rowY(s.dst) + ROW / 2;
    const g = el('g', {'class': 'send', 'data-src': s.src, 'data-dst': s.dst,
                       'data-ranges': s.ranges}, svg);
    el('path', {d: 'M ' + (ARROWS_X - 12) + ' ' + y0 + ' C ' + (x + 40) + ' ' + y0 + ', ' +
      (x + 40) + ' ' + y1 + ', ' + (ARROWS_X - 12) + ' ' + y1, fill: 'none',
      stroke: D.colours[s.src], 'stroke-width': 2, 'marker-end': 'url(#head)'}, g);
    el('text', {x: x + 44, y: y0 + 0.3 * (y1 - y0) + (y1 > y0 ? 4 : -4), fill: D.colours[s.src]}, g,
       s.src + '\u2192' + s.dst + ' [' + s.ranges + ']');
  });
  const st = document.getElementById('status');
  st.dataset.tick = tick;
  st.textContent = tick < 0 ? 'inputs (before tick 0) of ' + T + ' ticks'
    : 'tick ' + tick + ' of ' + T + ': ' + D.notes[tick] + ' (' + sends.length + ' sends)' +
      (D.observed ? '' : ' (opaque collective: the state is read from its outputs)');
  if (location.hash !== '#tick=' + tick) history.replaceState(null, '', '#tick=' + tick);
}
function drawTopology(svg, sends) {
  const P = D.topology.positions, C = 150, R = 110;
  const xy = i => [C + R * P[i][0], C + 20 - R * P[i][1]];
  const lit = new Set(sends.map(s => Math.min(s.src, s.dst) + '-' + Math.max(s.src, s.dst)));
  el('text', {x: 20, y: 20}, svg, 'links: ' + D.topology.kind);
  D.topology.links.forEach(([a, b]) => {
    const [xa, ya] = xy(a), [xb, yb] = xy(b);
    el('line', {x1: xa, y1: ya, x2: xb, y2: yb,
      'class': lit.has(a + '-' + b) ? 'link lit' : 'link'}, svg);
  });
  for (let i = 0; i < N; i++) {
    const [x, y] = xy(i);
    el('circle', {cx: x, cy: y, r: 13, fill: D.colours[i], stroke: '#000'}, svg);
    el('text', {x: x, y: y + 4, 'text-anchor': 'middle', fill: '#fff'}, svg, String(i));
  }
}
function go(t) { tick = Math.max(-1, Math.min(T - 1, t)); draw(); }
document.getElementById('first').onclick = () => go(-1);
document.getElementById('prev').onclick = () => go(tick - 1);
document.getElementById('next').onclick = () => go(tick + 1);
document.getElementById('last').onclick = () => go(T - 1);
document.addEventListener('keydown', e => {
  if (e.key === 'ArrowRight' || e.key === ' ') { go(tick + 1); e.preventDefault(); }
  if (e.key === 'ArrowLeft') go(tick - 1);
  if (e.key === 'Home') go(-1);
  if (e.key === 'End') go(T - 1);
});
function fromHash() {
  const q = new URLSearchParams(location.hash.slice(1));
  const t = parseInt(q.get('tick') || '-1', 10);
  go(isNaN(t) ? -1 : t);
  if (q.get('press') === 'next') document.getElementById('next').click();
  if (q.get('key')) document.dispatchEvent(new KeyboardEvent('keydown', {key: q.get('key')}));
}
window.addEventListener('hashchange', fromHash);
fromHash();
</script></body></html>
"""


def write_html(state: StateTrace, path: str | os.PathLike[str]) -> Path:
    """Write the step-through viewer for ``state``; returns ``path``."""
    title = str(state)
    data = json.dumps(viewer_data(state)).replace("</", "<\\/")
    page = _PAGE.replace("__TITLE__", html.escape(title)).replace("__DATA__", data)
    Path(path).write_text(page, encoding="utf-8")
    return Path(path)
