// phaselens view: the static explorer of one experiment (docs/view.md).
// Reads window.PHASELENS_DATA (data.js, written by `phaselens view`); fetches nothing.
(function () {
  'use strict';
  var D = window.PHASELENS_DATA;
  var S = { map: 0, phase: null, lock: null, sort: 'layer', ex: 0, shift: 0, layer: null, head: 'all', entry: null };
  var $ = function (id) { return document.getElementById(id); };
  var SVGNS = 'http://www.w3.org/2000/svg';

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    for (var k in (attrs || {})) {
      if (k === 'class') e.className = attrs[k]; else if (k === 'style') e.style.cssText = attrs[k]; else e.setAttribute(k, attrs[k]);
    }
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }
  function svg(tag, attrs) {
    var e = document.createElementNS(SVGNS, tag);
    for (var k in (attrs || {})) e.setAttribute(k, attrs[k]);
    return e;
  }
  function fmt(v, d) {
    if (v === null || v === undefined) return 'n/a';
    d = d === undefined ? 3 : d;
    var a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e4)) return v.toExponential(2);
    return v.toFixed(d);
  }
  function ci(lo, hi, d) { return (lo === null || hi === null || lo === undefined || hi === undefined) ? '' : ' [' + fmt(lo, d) + ', ' + fmt(hi, d) + ']'; }

  // ---------- tooltip ----------
  function tip(ev, text) {
    var t = $('tooltip');
    t.textContent = text; t.hidden = false;
    var x = (ev.clientX || 0) + 12, y = (ev.clientY || 0) + 12;
    t.style.left = Math.min(x, window.innerWidth - 370) + 'px'; t.style.top = y + 'px';
  }
  function untip() { $('tooltip').hidden = true; }

  // ---------- colours ----------
  // Diverging blue-white-red around 0 (signed metrics), sequential white-purple otherwise.
  function colour(v, lo, hi) {
    if (v === null) return '#ddd';
    if (lo < 0 && hi > 0) {
      var m = Math.max(-lo, hi), t = Math.max(-1, Math.min(1, v / m));
      var c = Math.round(255 * (1 - Math.abs(t)));
      return t >= 0 ? 'rgb(255,' + c + ',' + c + ')' : 'rgb(' + c + ',' + c + ',255)';
    }
    var u = hi > lo ? (v - lo) / (hi - lo) : 0.5;
    if (hi <= 0) u = 1 - u;
    u = Math.max(0, Math.min(1, u));
    return 'hsl(265,' + Math.round(20 + 60 * u) + '%,' + Math.round(97 - 62 * u) + '%)';
  }
  function headHue(h, n) { return Math.round(360 * h / Math.max(1, n)); }
  function phaseHue(p, P) { return Math.round(360 * p / Math.max(1, P)); }

  // ---------- header ----------
  function header() {
    $('title').textContent = D.experiment + ' (' + D.kind + ')';
    var sub = [];
    if (D.model) sub.push('model ' + D.model);
    if (D.description) sub.push(D.description);
    sub.push('tables: ' + (D.tables || []).join(', '));
    $('subtitle').textContent = sub.join(' \u00b7 ');
    (D.warnings || []).forEach(function (w) { $('warnings').appendChild(el('div', {}, w)); });
    var sc = D.scalars || {};
    var add = function (label, text, bad) {
      var h = el('div', { 'class': 'headline' + (bad ? ' bad' : '') });
      h.appendChild(el('b', {}, text)); h.appendChild(document.createTextNode(label));
      $('headlines').appendChild(h);
    };
    if (sc.mean_accuracy) add('mean accuracy' + ci(sc.mean_accuracy[1], sc.mean_accuracy[2]), fmt(sc.mean_accuracy[0]));
    if (sc.worst_phase) add('worst phase', String(sc.worst_phase[0]), true);
    if (sc.phase_gap_pp) add('phase gap (pp)' + ci(sc.phase_gap_pp[1], sc.phase_gap_pp[2]), fmt(sc.phase_gap_pp[0], 1));
    $('footer').textContent = 'Written by ' + D.generator + ' from ' + (D.tables || []).join(', ') + '. Static page: nothing is fetched.';
  }

  // ---------- accuracy by phase ----------
  function accuracySeries() {
    return (D.series || []).filter(function (s) { return s.layer === null && /^accuracy/.test(s.metric); });
  }
  function lineChart(host, series, opts) {
    var W = 560, H = 220, L = 46, R = 130, T = 12, B = 32;
    var xs = [], ymin = opts.y0 !== undefined ? opts.y0 : Infinity, ymax = opts.y1 !== undefined ? opts.y1 : -Infinity;
    series.forEach(function (s) { s.points.forEach(function (p) {
      xs.push(p[0]);
      [p[1], p[2], p[3]].forEach(function (v) { if (v !== null) { ymin = Math.min(ymin, v); ymax = Math.max(ymax, v); } });
    }); });
    if (!xs.length) return null;
    if (ymin === ymax) { ymin -= 0.5; ymax += 0.5; }
    var x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs);
    var sx = function (x) { return L + (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5) * (W - L - R); };
    var sy = function (y) { return T + (1 - (y - ymin) / (ymax - ymin)) * (H - T - B); };
    var g = svg('svg', { width: W, height: H, viewBox: '0 0 ' + W + ' ' + H, 'class': 'chart' });
    g.appendChild(svg('line', { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: '#889' }));
    g.appendChild(svg('line', { x1: L, y1: T, x2: L, y2: H - B, stroke: '#889' }));
    for (var x = x0; x <= x1; x++) {
      var t = svg('text', { x: sx(x), y: H - B + 14, 'text-anchor': 'middle' }); t.textContent = x; g.appendChild(t);
    }
    [ymin, (ymin + ymax) / 2, ymax].forEach(function (v) {
      var t = svg('text', { x: L - 4, y: sy(v) + 4, 'text-anchor': 'end' }); t.textContent = fmt(v, 2); g.appendChild(t);
    });
    var xl = svg('text', { x: (L + W - R) / 2, y: H - 4, 'text-anchor': 'middle' }); xl.textContent = opts.xlabel || 'phase of the target key'; g.appendChild(xl);
    if (S.phase !== null) g.appendChild(svg('line', { x1: sx(S.phase), x2: sx(S.phase), y1: T, y2: H - B, stroke: '#c0392b', 'stroke-dasharray': '3,3' }));
    series.forEach(function (s, i) {
      var hue = Math.round(210 + 97 * i) % 360, band = '', line = '';
      var pts = s.points.filter(function (p) { return p[1] !== null; });
      pts.forEach(function (p, j) { line += (j ? 'L' : 'M') + sx(p[0]) + ',' + sy(p[1]); });
      var up = pts.filter(function (p) { return p[2] !== null && p[3] !== null; });
      up.forEach(function (p, j) { band += (j ? 'L' : 'M') + sx(p[0]) + ',' + sy(p[3]); });
      up.slice().reverse().forEach(function (p) { band += 'L' + sx(p[0]) + ',' + sy(p[2]); });
      if (up.length) g.appendChild(svg('path', { d: band + 'Z', fill: 'hsla(' + hue + ',60%,55%,0.18)', stroke: 'none' }));
      g.appendChild(svg('path', { d: line, fill: 'none', stroke: 'hsl(' + hue + ',60%,40%)', 'stroke-width': 2 }));
      var lab = svg('text', { x: W - R + 6, y: H - B - 14 * (series.length - 1 - i) }); lab.textContent = s.label || s.metric; lab.setAttribute('fill', 'hsl(' + hue + ',60%,35%)'); g.appendChild(lab);
      var worst = null, best = null;
      pts.forEach(function (p) { if (worst === null || p[1] < worst[1]) worst = p; if (best === null || p[1] > best[1]) best = p; });
      pts.forEach(function (p) {
        var isW = opts.worst && p === worst;
        var c = svg('circle', { cx: sx(p[0]), cy: sy(p[1]), r: isW ? 6 : 4, fill: isW ? '#c0392b' : 'hsl(' + hue + ',60%,40%)', 'class': 'phase-pt', 'data-phase': p[0], 'data-series': s.metric });
        c.addEventListener('mousemove', function (ev) { tip(ev, (s.label || s.metric) + ', phase ' + p[0] + ': ' + fmt(p[1]) + ci(p[2], p[3]) + ' n=' + p[4] + (isW ? ' (worst phase)' : '')); });
        c.addEventListener('mouseleave', untip);
        c.addEventListener('click', function () { selectPhase(p[0]); });
        g.appendChild(c);
      });
      if (opts.worst && i === 0 && worst && best && best[1] > worst[1]) {
        var gx = sx(x1) + 4;
        g.appendChild(svg('path', { d: 'M' + (gx + 4) + ',' + sy(best[1]) + 'H' + gx + 'V' + sy(worst[1]) + 'H' + (gx + 4), stroke: '#c0392b', fill: 'none' }));
        var gt = svg('text', { x: gx + 8, y: (sy(best[1]) + sy(worst[1])) / 2 + 4, fill: '#c0392b', 'class': 'gap-label' });
        gt.textContent = 'gap ' + (100 * (best[1] - worst[1])).toFixed(1) + ' pp';
        g.appendChild(gt);
      }
    });
    host.appendChild(g);
    return g;
  }
  function accuracy() {
    var host = $('accuracy'); host.textContent = '';
    if (D.view === 'grid') return gridAccuracy(host);
    var s = accuracySeries();
    if (!s.length) { host.appendChild(el('p', { 'class': 'empty' }, 'The tables of this experiment hold no per-phase accuracy rows.')); return; }
    lineChart(host, s, { y0: 0, y1: 1, worst: true });
  }

  // ---------- grid: design x phase ----------
  function gridAccuracy(host) {
    var cells = (D.grid_cells || []).filter(function (c) { return c[2] === 'final'; });
    var protos = []; cells.forEach(function (c) { if (protos.indexOf(c[1]) < 0) protos.push(c[1]); });
    if (!cells.length) { host.appendChild(el('p', { 'class': 'empty' }, 'The grid table has no final-query rows yet (no design swept).')); return; }
    gridFrontier(host);
    protos.forEach(function (pr) {
      var phases = []; cells.forEach(function (c) { if (c[1] === pr && phases.indexOf(c[5]) < 0) phases.push(c[5]); });
      phases.sort(function (a, b) { return a - b; });
      var box = el('div', { 'class': 'map' }); box.appendChild(el('h3', {}, 'accuracy, design x phase (' + pr + ' padding); worst phase of each design outlined'));
      var tb = el('table'), tr = el('tr'); tr.appendChild(el('th'));
      phases.forEach(function (p) { tr.appendChild(el('th', { 'class': 'col' }, String(p))); });
      tr.appendChild(el('th', {}, 'gap pp')); tb.appendChild(tr);
      (D.designs || []).forEach(function (d) {
        var row = cells.filter(function (c) { return c[0] === d && c[1] === pr; });
        if (!row.length) return;
        var worst = row.reduce(function (a, c) { return c[6] !== null && (a === null || c[6] < a[6]) ? c : a; }, null);
        var r = el('tr'); r.appendChild(el('th', {}, d));
        phases.forEach(function (p) {
          var c = row.filter(function (x) { return x[5] === p; })[0];
          var td = el('td', { 'class': 'cell' + (c ? '' : ' missing'), 'data-design': d, 'data-phase': p });
          if (c) {
            td.style.background = colour(c[6], 0, 1);
            if (c === worst) td.style.outline = '2px solid #c0392b';
            td.addEventListener('mousemove', function (ev) { tip(ev, d + ', ' + pr + ', phase ' + p + ': accuracy ' + fmt(c[6]) + ci(c[7], c[8]) + ' n=' + c[9]); });
            td.addEventListener('mouseleave', untip);
            td.addEventListener('click', function () { gridDesign(d, pr); });
          }
          r.appendChild(td);
        });
        var sm = (D.summary || []).filter(function (x) { return x[0] === d && x[1] === pr; })[0];
        r.appendChild(el('th', {}, sm ? fmt(sm[2], 1) + ci(sm[3], sm[4], 1) : ''));
        tb.appendChild(r);
      });
      box.appendChild(tb); host.appendChild(box);
    });
    host.appendChild(el('div', { id: 'grid-design' }));
  }
  // The designs pooled over seeds (grid_frontier.arrow): per protocol mean accuracy and
  // phase gap (mean +- sd over seeds, 95% CI), worst phase and the gate's verdict; a
  // click draws the design's seeds' accuracy by phase.
  function gridFrontier(host) {
    var rows = D.frontier || [];
    if (!rows.length) return;
    var designs = [], protos = [];
    rows.forEach(function (r) { if (designs.indexOf(r[0]) < 0) designs.push(r[0]); if (protos.indexOf(r[1]) < 0) protos.push(r[1]); });
    var gate = rows[0][16];
    var box = el('div', { 'class': 'map', id: 'frontier' });
    box.appendChild(el('h3', {}, 'designs pooled over seeds: mean accuracy and phase gap of the final query (mean \u00b1 sd over seeds, 95% CI); verdict against the ' + fmt(gate, 1) + ' pp gate; click a design for its seeds\u2019 accuracy by phase'));
    var tb = el('table', { 'class': 'frontier' }), top = el('tr'), tr = el('tr');
    top.appendChild(el('th', { colspan: 2 }));
    tr.appendChild(el('th', {}, 'design'));
    tr.appendChild(el('th', {}, 'seeds'));
    protos.forEach(function (pr) {
      top.appendChild(el('th', { colspan: 4, 'class': 'group' }, pr + ' padding'));
      ['mean acc', 'gap pp', 'worst (acc)', 'verdict'].forEach(function (h) { tr.appendChild(el('th', { 'class': 'col' }, h)); });
    });
    tb.appendChild(top); tb.appendChild(tr);
    var pm = function (v, sd, d) { return fmt(v, d) + (sd !== null && sd !== undefined ? ' \u00b1 ' + fmt(sd, d) : ''); };
    designs.forEach(function (d) {
      var r = el('tr', { 'class': 'frontier-row', 'data-design': d });
      var first = rows.filter(function (x) { return x[0] === d; })[0];
      r.appendChild(el('th', {}, d));
      r.appendChild(el('td', {}, first[2] + (first[3] > first[2] ? ' of ' + first[3] : '')));
      protos.forEach(function (pr) {
        var x = rows.filter(function (y) { return y[0] === d && y[1] === pr; })[0];
        if (!x) { for (var k = 0; k < 4; k++) r.appendChild(el('td', { 'class': 'missing' }, '')); return; }
        var sd = x[2] > 1;
        r.appendChild(el('td', {}, pm(x[5], sd ? x[6] : null, 2) + ci(x[7], x[8], 2)));
        r.appendChild(el('td', {}, pm(x[9], sd ? x[10] : null, 1) + ci(x[11], x[12], 1)));
        r.appendChild(el('td', {}, x[13] === null ? 'n/a' : x[13] + ' (' + fmt(x[14], 2) + ')'));
        r.appendChild(el('td', { 'class': 'verdict verdict-' + x[15], 'data-protocol': pr }, x[15]));
      });
      r.addEventListener('click', function () { gridSeeds(d, protos[0]); });
      tb.appendChild(r);
    });
    box.appendChild(tb);
    host.appendChild(box);
  }
  function gridSeeds(d, pr) {
    var host = $('grid-design'); host.textContent = '';
    var f = (D.frontier || []).filter(function (x) { return x[0] === d && x[1] === pr; })[0];
    var members = f ? f[4] : [d];
    var series = members.map(function (m) {
      return { metric: 'accuracy', label: m, points: (D.grid_cells || []).filter(function (c) { return c[0] === m && c[1] === pr && c[2] === 'final'; })
        .map(function (c) { return [c[5], c[6], c[7], c[8], c[9]]; }).sort(function (a, b) { return a[0] - b[0]; }) };
    }).filter(function (s) { return s.points.length; });
    host.appendChild(el('h3', {}, d + ' (' + pr + ' padding): accuracy by phase of each seed, 95% Wilson bands'));
    if (!series.length) { host.appendChild(el('p', { 'class': 'empty' }, 'No merged seed of ' + d + ' has ' + pr + ' rows.')); return; }
    lineChart(host, series, { y0: 0, y1: 1, worst: true });
  }
  function gridDesign(d, pr) {
    var host = $('grid-design'); host.textContent = '';
    var pts = (D.grid_cells || []).filter(function (c) { return c[0] === d && c[1] === pr && c[2] === 'final'; })
      .map(function (c) { return [c[5], c[6], c[7], c[8], c[9]]; }).sort(function (a, b) { return a[0] - b[0]; });
    host.appendChild(el('h3', {}, d + ' (' + pr + ' padding): accuracy by phase, 95% Wilson band'));
    lineChart(host, [{ metric: 'accuracy', label: d, points: pts }], { y0: 0, y1: 1, worst: true });
  }

  // ---------- head x phase maps ----------
  function mapName(m) { return m.metric + ' (' + (m.head_kind === 'kv' ? 'KV heads' : 'query heads') + ')'; }
  function cellIndex(m) {
    if (m._idx) return m._idx;
    var idx = {}; m.cells.forEach(function (c) { idx[c[0] + '.' + c[1] + '.' + c[2]] = c; });
    m._idx = idx; return idx;
  }
  function specialization(m, l, h) {
    var idx = cellIndex(m), v = m.phases.map(function (p) { var c = idx[l + '.' + h + '.' + p]; return c && c[3] !== null ? Math.max(0, c[3]) : 0; });
    var tot = v.reduce(function (a, b) { return a + b; }, 0);
    if (tot <= 0 || m.phases.length < 2) return 0;
    var H = 0; v.forEach(function (x) { if (x > 0) { var q = x / tot; H -= q * Math.log(q); } });
    return 1 - (Math.exp(H) - 1) / (m.phases.length - 1);
  }
  function headOrder(m) {
    var rows = [];
    m.layers.forEach(function (l) { m.heads.forEach(function (h) { rows.push([l, h]); }); });
    if (S.sort === 'spec') rows.sort(function (a, b) { return specialization(m, b[0], b[1]) - specialization(m, a[0], a[1]); });
    if (S.sort === 'phase' && S.phase !== null) {
      var idx = cellIndex(m), val = function (r) { var c = idx[r[0] + '.' + r[1] + '.' + S.phase]; return c && c[3] !== null ? Math.abs(c[3]) : -1; };
      rows.sort(function (a, b) { return val(b) - val(a); });
    }
    return rows;
  }
  function headLabel(m, l, h) { return 'L' + l + (m.head_kind === 'kv' ? '.KV' : '.H') + h; }
  function range(m) {
    var lo = Infinity, hi = -Infinity;
    m.cells.forEach(function (c) { if (c[3] !== null) { lo = Math.min(lo, c[3]); hi = Math.max(hi, c[3]); } });
    if (lo === Infinity) { lo = 0; hi = 1; }
    return [lo, hi];
  }
  function drawMap(m, mi) {
    var box = el('div', { 'class': 'map', 'data-metric': m.metric, 'data-head-kind': m.head_kind });
    box.appendChild(el('h3', {}, mapName(m)));
    var rg = range(m), idx = cellIndex(m), tb = el('table'), tr = el('tr');
    tr.appendChild(el('th', {}, 'head \\ phase'));
    m.phases.forEach(function (p) {
      var th = el('th', { 'class': 'col' + (p === S.phase ? ' selected' : '') }, String(p));
      th.addEventListener('click', function () { selectPhase(p); });
      tr.appendChild(th);
    });
    tb.appendChild(tr);
    headOrder(m).forEach(function (r) {
      var row = el('tr'); row.appendChild(el('th', {}, headLabel(m, r[0], r[1])));
      m.phases.forEach(function (p) {
        var c = idx[r[0] + '.' + r[1] + '.' + p];
        var td = el('td', { 'class': 'cell', 'data-map': mi, 'data-layer': r[0], 'data-head': r[1], 'data-phase': p });
        if (!c) { td.className += ' missing'; td.title = 'not in the tables'; row.appendChild(td); return; }
        td.setAttribute('data-value', c[3] === null ? 'NaN' : String(c[3]));
        td.style.background = colour(c[3], rg[0], rg[1]);
        if (p === S.phase) td.className += ' selcol';
        var L = S.lock;
        if (L && L.map === mi && L.layer === r[0] && L.head === r[1] && L.phase === p) td.className += ' locked';
        td.addEventListener('mousemove', function (ev) { tip(ev, cellText(m, c)); });
        td.addEventListener('mouseleave', untip);
        td.addEventListener('click', function () { lockCell(mi, r[0], r[1], p); });
        row.appendChild(td);
      });
      tb.appendChild(row);
    });
    box.appendChild(tb);
    var sc = el('div', { 'class': 'scale' }), bar = el('div', { 'class': 'bar' });
    var stops = [0, 0.25, 0.5, 0.75, 1].map(function (t) { return colour(rg[0] + t * (rg[1] - rg[0]), rg[0], rg[1]); });
    bar.style.background = 'linear-gradient(90deg,' + stops.join(',') + ')';
    sc.appendChild(el('span', {}, fmt(rg[0], 2))); sc.appendChild(bar); sc.appendChild(el('span', {}, fmt(rg[1], 2)));
    box.appendChild(sc);
    return box;
  }
  function cellText(m, c) {
    return m.metric + ' ' + headLabel(m, c[0], c[1]) + ', phase ' + c[2] + ': ' + fmt(c[3]) + ci(c[4], c[5]) + ', n=' + c[6];
  }
  function maps() {
    var host = $('maps'); host.textContent = '';
    var ms = D.maps || [];
    if (!ms.length) {
      host.appendChild(el('p', { 'class': 'empty', id: 'no-maps' }, D.view === 'grid'
        ? 'A grid has no per-head tables: see the design x phase accuracy above.'
        : 'This experiment kind (' + D.kind + ') writes no per-head metrics: no head x phase map to draw. Its per-phase measures are below.'));
      return;
    }
    var sel = $('metric-select').value;
    ms.forEach(function (m, i) { if (sel === 'all' || Number(sel) === i) host.appendChild(drawMap(m, i)); });
    var L = S.lock;
    $('lock-status').textContent = L ? 'locked: ' + mapName(ms[L.map]) + ' ' + headLabel(ms[L.map], L.layer, L.head) + ', phase ' + L.phase + ' (click it again to unlock)' : '';
  }
  function mapControls() {
    var s = $('metric-select'); s.textContent = '';
    s.appendChild(el('option', { value: 'all' }, 'all (small multiples)'));
    (D.maps || []).forEach(function (m, i) { s.appendChild(el('option', { value: String(i) }, mapName(m))); });
    s.addEventListener('change', function () { if (s.value !== 'all') S.map = Number(s.value); render(); });
    $('sort-select').addEventListener('change', function () { S.sort = $('sort-select').value; render(); });
  }

  // ---------- selection ----------
  function selectPhase(p) {
    S.phase = p;
    var ex = exemplarsOf(S.ex);
    for (var i = 0; i < ex.length; i++) if (ex[i].phase === p) S.shift = i;
    render();
  }
  function lockCell(mi, l, h, p) {
    var L = S.lock;
    if (L && L.map === mi && L.layer === l && L.head === h && L.phase === p) { S.lock = null; render(); return; }
    S.lock = { map: mi, layer: l, head: h, phase: p };
    S.map = mi; S.layer = l;
    S.head = D.maps[mi].head_kind === 'kv' ? 'all' : h;
    S.entry = null;
    selectPhase(p);
  }

  // ---------- interventions ----------
  function interventions() {
    var host = $('interventions'); host.textContent = '';
    var m = (D.maps || [])[S.map];
    if (!m) { host.appendChild(el('p', { 'class': 'empty' }, 'No per-head effects in this experiment.')); return; }
    var p = S.phase !== null ? S.phase : m.phases[0];
    var idx = cellIndex(m), rows = [];
    m.layers.forEach(function (l) { m.heads.forEach(function (h) { var c = idx[l + '.' + h + '.' + p]; if (c && c[3] !== null) rows.push(c); }); });
    rows.sort(function (a, b) { return Math.abs(b[3]) - Math.abs(a[3]); });
    host.appendChild(el('p', { 'class': 'help' }, mapName(m) + ' at phase ' + p + (D.kind ? ' (' + D.kind + ')' : '')));
    var mx = rows.reduce(function (a, c) { return Math.max(a, Math.abs(c[3])); }, 0) || 1;
    var bars = el('div', { 'class': 'bars' });
    rows.slice(0, 24).forEach(function (c) {
      var L = S.lock, locked = L && L.map === S.map && L.layer === c[0] && L.head === c[1] && L.phase === p;
      var r = el('div', { 'class': 'barrow' + (locked ? ' locked' : ''), 'data-layer': c[0], 'data-head': c[1] });
      r.appendChild(el('span', { 'class': 'lab' }, headLabel(m, c[0], c[1])));
      var tr = el('span', { 'class': 'track' }), f = el('span', { 'class': 'fill' });
      var w = 50 * Math.abs(c[3]) / mx;
      f.style.cssText = 'left:' + (c[3] >= 0 ? 50 : 50 - w) + '%;width:' + w + '%;background:' + (c[3] >= 0 ? '#c0392b' : '#2471a3');
      tr.appendChild(f); r.appendChild(tr);
      r.appendChild(el('span', { 'class': 'num' }, fmt(c[3])));
      r.addEventListener('mousemove', function (ev) { tip(ev, cellText(m, c)); });
      r.addEventListener('mouseleave', untip);
      r.addEventListener('click', function () { lockCell(S.map, c[0], c[1], p); });
      bars.appendChild(r);
    });
    host.appendChild(bars);
  }

  // ---------- other per-phase series ----------
  function other() {
    var host = $('other'); host.textContent = '';
    var acc = accuracySeries(), rest = (D.series || []).filter(function (s) { return acc.indexOf(s) < 0; });
    if (!rest.length) { $('other-section').hidden = true; return; }
    var groups = {};
    rest.forEach(function (s) { (groups[s.metric] = groups[s.metric] || []).push(s); });
    Object.keys(groups).slice(0, 12).forEach(function (k) {
      var box = el('div', { 'class': 'map', style: 'display:inline-block;margin:4px' });
      box.appendChild(el('h3', {}, k));
      lineChart(box, groups[k].map(function (s) { return { metric: k, label: s.layer === null ? 'model' : 'layer ' + s.layer, points: s.points }; }), {});
      host.appendChild(box);
    });
  }

  // ---------- exemplars: prompt view ----------
  function logicals() {
    var out = []; (D.exemplars || []).forEach(function (e) { if (out.indexOf(e.logical) < 0) out.push(e.logical); });
    return out;
  }
  function exemplarsOf(i) {
    var lg = logicals()[i];
    return (D.exemplars || []).filter(function (e) { return e.logical === lg; }).sort(function (a, b) { return a.shift - b.shift; });
  }
  function current() { var ex = exemplarsOf(S.ex); return ex[Math.min(S.shift, ex.length - 1)]; }
  function mark(r, k) { var m = r.marks[k]; return m ? m[0] : null; }
  function layerOf(r, l) { return r.layers.filter(function (x) { return x.layer === l; })[0]; }
  function nHeads(lay) { var n = 0; (lay.pattern || []).forEach(function (p) { n = Math.max(n, p[0] + 1); }); return n; }
  // Attention weight of (head | max over heads) per slot; returns [weights, argmax head].
  function weights(lay, head) {
    var w = {}, who = {};
    (lay.pattern || []).forEach(function (p) {
      if (head !== 'all' && p[0] !== head) return;
      if (w[p[1]] === undefined || p[2] > w[p[1]]) { w[p[1]] = p[2]; who[p[1]] = p[0]; }
    });
    return [w, who];
  }
  function entryState(lay, e, q) {
    var sel = (lay.indexer_selected || []).filter(function (x) { return x[0] === e[0]; })[0];
    var closed = e[2] <= q;
    if (!closed) return 'masked';
    if (sel && sel[1] < 0.5) return 'unselected';
    return 'attended';
  }
  function entriesHolding(lay, pos) { return (lay.entry_span || []).filter(function (e) { return e[1] <= pos && pos <= e[2]; }); }
  function indexerRank(lay, w, q) {
    var sc = lay.indexer_score || []; if (!sc.length) return null;
    var closed = (lay.entry_span || []).filter(function (e) { return e[2] <= q; }).map(function (e) { return e[0]; });
    var mine = sc.filter(function (s) { return s[0] === w; })[0]; if (!mine) return null;
    var rank = sc.filter(function (s) { return closed.indexOf(s[0]) >= 0 && s[1] > mine[1]; }).length;
    return [rank, closed.length];
  }
  function stride(lay) { return lay.layer_kind && lay.layer_kind[0] ? lay.layer_kind[0] : 0; }
  // A select / evict overlay layer: its kind, grid offset, the block of a token, the
  // blocks kept at the read position, and whether the read position reads a token.
  function overlayKind(lay) { var k = lay && lay.layer_kind ? lay.layer_kind[1] || '' : ''; return /^(select|evict) /.test(k) ? k.split(' ')[0] : null; }
  function gridOff(lay) { return lay && lay.layer_kind && lay.layer_kind[2] ? lay.layer_kind[2] : 0; }
  function phaseOf(pos, P, off) { return (((pos - off) % P) + P) % P; }
  function blockOf(pos, B, off) { return pos < off ? 0 : Math.floor((pos - off) / B) + (off > 0 ? 1 : 0); }
  function blockStart(b, B, off) { return off > 0 ? (b === 0 ? 0 : off + (b - 1) * B) : b * B; }
  function keptSet(lay) { var k = {}; (lay.indexer_selected || []).forEach(function (x) { k[x[0]] = x[1] >= 0.5; }); return k; }
  function overlayLayers(r) { return r.layers.filter(function (x) { return overlayKind(x) && (x.indexer_selected || []).length; }); }
  function readsToken(r, lay, pos) {
    var q = mark(r, 'query_pos'), win = mark(r, 'overlay_window'), sinks = mark(r, 'overlay_sinks') || 0;
    if (pos > q) return false;
    if (pos >= win || pos < sinks) return true;
    return !!keptSet(lay)[blockOf(pos, stride(lay), gridOff(lay))];
  }
  // Block b of an overlay layer at the read position: 'window' (not a candidate: every
  // token of it is read raw), 'kept' or 'dropped'; its score and rank among candidates.
  function blockState(r, lay, b) {
    var B = stride(lay), off = gridOff(lay), win = mark(r, 'overlay_window');
    if (overlayKind(lay) === 'select' && blockStart(b, B, off) >= win) return 'window';
    return keptSet(lay)[b] ? 'kept' : 'dropped';
  }
  function blockRank(r, lay, b) {
    var sc = lay.indexer_score || [], mine = sc.filter(function (s) { return s[0] === b; })[0];
    if (!mine) return null;
    var cand = sc.filter(function (s) { return blockState(r, lay, s[0]) !== 'window'; });
    return [mine[1], cand.filter(function (s) { return s[1] > mine[1]; }).length, cand.length];
  }
  function blockText(r, lay, b) {
    var B = stride(lay), off = gridOff(lay), word = overlayKind(lay) === 'evict' ? 'chunk' : 'block', st = blockState(r, lay, b);
    var a = blockStart(b, B, off), z = blockStart(b + 1, B, off) - 1, rk = blockRank(r, lay, b);
    var t = 'layer ' + lay.layer + ', ' + word + ' ' + b + ' (tokens ' + a + '..' + z + '): ' +
      (st === 'window' ? 'inside the raw window (read, not a candidate)' : st === 'kept' ? 'kept' : (overlayKind(lay) === 'evict' ? 'evicted' : 'not selected'));
    if (rk) t += ', score ' + fmt(rk[0]) + (st === 'window' ? '' : ', rank ' + rk[1] + ' of ' + rk[2] + ' candidates (0 = top)');
    return t;
  }
  function promptControls() {
    var es = $('exemplar-select'); es.textContent = '';
    logicals().forEach(function (lg, i) { es.appendChild(el('option', { value: String(i) }, 'logical example ' + lg)); });
    es.addEventListener('change', function () { S.ex = Number(es.value); render(); });
    $('layer-select').addEventListener('change', function () { S.layer = Number($('layer-select').value); S.entry = null; render(); });
    $('head-select').addEventListener('change', function () { var v = $('head-select').value; S.head = v === 'all' ? 'all' : Number(v); render(); });
    $('shift-slider').addEventListener('input', function () { S.shift = Number($('shift-slider').value); var r = current(); if (r) S.phase = r.phase; render(); });
  }
  function fillLayerHead(r) {
    var ls = $('layer-select'), hs = $('head-select');
    ls.textContent = ''; hs.textContent = '';
    r.layers.forEach(function (lay) { ls.appendChild(el('option', { value: String(lay.layer) }, 'layer ' + lay.layer + ' (' + (lay.layer_kind ? lay.layer_kind[1] : '') + ')')); });
    if (S.layer === null || !layerOf(r, S.layer)) {
      var firstC = r.layers.filter(function (x) { return stride(x) > 0; })[0] || r.layers[0];
      S.layer = firstC.layer;
    }
    ls.value = String(S.layer);
    var lay = layerOf(r, S.layer);
    hs.appendChild(el('option', { value: 'all' }, 'all heads (max, hue = head)'));
    for (var h = 0; h < nHeads(lay); h++) hs.appendChild(el('option', { value: String(h) }, 'head ' + h));
    hs.value = String(S.head);
  }
  function prompt() {
    var host = $('prompt'); host.textContent = ''; $('entry-detail').textContent = '';
    if (!D.exemplars || !D.exemplars.length) {
      host.appendChild(el('p', { 'class': 'empty', id: 'no-exemplars' }, 'No exemplar table for this experiment (see the warning above): the prompt view and the phase shift need notebooks-data/' + D.experiment + '/exemplars.arrow, which `phaselens view` captures from the experiment\'s model.'));
      $('shift-panel').hidden = true;
      return;
    }
    var r = current(); if (!r) return;
    fillLayerHead(r);
    var lay = layerOf(r, S.layer), q = mark(r, 'query_pos'), key = mark(r, 'key_pos'), val = mark(r, 'value_pos');
    var P = mark(r, 'period') || 1, st = stride(lay) || P, tw = 30, off = gridOff(lay), ovl = overlayKind(lay);
    var ww = weights(lay, S.head), w = ww[0], who = ww[1], nE = (lay.entry_span || []).length, nH = nHeads(lay);
    var legend = el('div', { 'class': 'legend' });
    ['phase colour band on top of each token (t mod ' + P + '); thick line = window boundary every S=' + st,
      (mark(r, 'phase_pos') === val ? 'red box: the needle sentence (t=' + key + '); blue: its value (t=' + val + ', phase ' + r.phase + ')' : 'red box: target key (t=' + key + ', phase ' + r.phase + '); blue: its value') + '; black: read position (t=' + q + ')',
      'token / entry lightness = attention weight' + (S.head === 'all' ? ' (max over heads; hue = the head that attends most)' : ' of head ' + S.head),
      ovl ? 'overlay ' + lay.layer_kind[1] + ': struck-through grey tokens are in ' + (ovl === 'evict' ? 'evicted chunks' : 'blocks the read position did not select') + '; from t=' + mark(r, 'overlay_window') + ' on, its ' + (ovl === 'evict' ? 'observation window' : 'raw window') + ' (always read)'
        : 'entries: solid = attended, dashed orange = available but not selected by the indexer, dotted grey = masked (window not closed)'].forEach(function (t) { legend.appendChild(el('span', {}, t)); });
    host.appendChild(legend);
    var strip = el('div', { 'class': 'strip', id: 'token-strip' });
    var shade = function (wt, hd) {
      if (!wt) return 'transparent';
      var hue = S.head === 'all' ? headHue(hd, nH) : 15;
      return 'hsl(' + hue + ',85%,' + Math.round(96 - 50 * Math.min(1, wt)) + '%)';
    };
    r.tokens.forEach(function (t) {
      var pos = t[0], d = el('span', { 'class': 'tok', 'data-pos': pos });
      if (phaseOf(pos, st, off) === 0) d.className += ' boundary';
      if (pos === key) d.className += ' key'; if (pos === val) d.className += ' value'; if (pos === q) d.className += ' query';
      if (ovl && pos <= q && !readsToken(r, lay, pos)) d.className += ' dropped';
      var ph = el('span', { 'class': 'ph' }); ph.style.background = 'hsl(' + phaseHue(phaseOf(pos, P, off), P) + ',70%,60%)'; d.appendChild(ph);
      var slot = nE + pos, wt = w[slot];
      var wd = el('span', { 'class': 'w' }, t[2]); wd.style.background = shade(wt, who[slot]); d.appendChild(wd);
      d.appendChild(el('span', { 'class': 'i' }, String(pos)));
      d.addEventListener('mousemove', function (ev) { tip(ev, 'token ' + pos + ' "' + t[2] + '" phase ' + phaseOf(pos, P, off) + (lay.raw_slots ? ', attention ' + fmt(wt || 0) + (S.head === 'all' && wt ? ' (head ' + who[slot] + ')' : '') : '') + (ovl && pos <= q ? (readsToken(r, lay, pos) ? '' : ', not read (' + (ovl === 'evict' ? 'evicted' : 'block not selected') + ')') : '')); });
      d.addEventListener('mouseleave', untip);
      strip.appendChild(d);
    });
    host.appendChild(strip);
    var needle = entriesHolding(lay, key).map(function (e) { return e[0]; });
    var lanes = 1; (lay.entry_span || []).forEach(function (e) { lanes = Math.max(lanes, Math.ceil((e[2] - e[1] + 1) / Math.max(1, st))); });
    var ents = el('div', { 'class': 'entries', id: 'entries' }); ents.style.height = (18 * lanes + 4) + 'px';
    ents.style.width = (tw * r.tokens.length) + 'px';
    (lay.entry_span || []).forEach(function (e) {
      var a = Math.max(0, e[1]), state = entryState(lay, e, q), wt = w[e[0]];
      var b = el('div', { 'class': 'entry ' + state + (needle.indexOf(e[0]) >= 0 ? ' needle' : '') + (S.entry === e[0] ? ' locked' : ''), 'data-entry': e[0] }, 'e' + e[0]);
      b.style.left = (a * tw) + 'px'; b.style.width = ((e[2] - a + 1) * tw - 2) + 'px'; b.style.top = (18 * (e[0] % lanes)) + 'px';
      if (state !== 'masked') b.style.background = shade(wt, who[e[0]]);
      b.addEventListener('mousemove', function (ev) { tip(ev, entryText(lay, e, state, wt, q)); });
      b.addEventListener('mouseleave', untip);
      b.addEventListener('click', function () { S.entry = S.entry === e[0] ? null : e[0]; prompt(); });
      ents.appendChild(b);
    });
    host.appendChild(ents);
    var info = el('p', { id: 'needle-info' });
    var txt = 'Needle: key token at t=' + key + ' (phase ' + r.phase + ')';
    if (ovl) {
      var np = mark(r, 'phase_pos'), nb = blockOf(np, st, off);
      txt = 'Needle: ' + (np === val ? 'value' : 'key') + ' at t=' + np + ' (phase ' + r.phase + '): ' + blockText(r, lay, nb);
    } else if (needle.length) {
      txt += ' is pooled into entr' + (needle.length > 1 ? 'ies ' : 'y ') + needle.map(function (n) { return 'e' + n; }).join(', ');
      var rk = indexerRank(lay, needle[needle.length - 1], q);
      if (rk) txt += '; indexer rank of e' + needle[needle.length - 1] + ': ' + rk[0] + ' of ' + rk[1] + ' closed entries (0 = top)';
    } else txt += (stride(lay) ? ' is in no closed entry of this layer' : ' (layer without compressed entries)');
    txt += '. Answer "' + (r.marks.answer_prob[1] || '') + '" probability ' + fmt(r.marks.answer_prob[0]) + '; top token "' + (r.marks.top_prob[1] || '') + '" (' + fmt(r.marks.top_prob[0]) + ').';
    info.textContent = txt; host.appendChild(info);
    if (S.entry !== null) entryDetail(lay, S.entry, q, key);
    else if (needle.length) entryDetail(lay, needle[needle.length - 1], q, key);
    overlayPanel(r);
  }
  // The overlay's choice at the read position: layers x blocks (or chunks), the block
  // holding the needle outlined; click a row for that layer's prompt view.
  function overlayPanel(r) {
    var host = $('overlay'); host.textContent = '';
    var lays = overlayLayers(r);
    if (!lays.length) { host.hidden = true; return; }
    host.hidden = false;
    var lay0 = lays[0], kind = overlayKind(lay0), B = stride(lay0), off = gridOff(lay0), word = kind === 'evict' ? 'chunk' : 'block';
    var q = mark(r, 'query_pos'), np = mark(r, 'phase_pos'), needle = blockOf(np, B, off), nb = 0;
    lays.forEach(function (x) { nb = Math.max(nb, x.indexer_selected.length); });
    host.appendChild(el('h3', {}, 'What the overlay kept at the read position (t=' + q + '): ' + lay0.layer_kind[1]));
    host.appendChild(el('p', { 'class': 'help' }, 'Rows: layers; columns: ' + word + 's of ' + B + ' tokens (grid offset ' + off + '). Dark = kept, light = ' +
      (kind === 'evict' ? 'evicted (for every query from the observation window on)' : 'not selected by this query') + (kind === 'select' ? ', hatched = inside the raw window (read, not a candidate)' : '') +
      '; red outline = the ' + word + ' holding the needle (' + (np === mark(r, 'value_pos') ? 'value' : 'key') + ' at t=' + np + ', phase ' + r.phase + '). Hover for the score and rank (attn.indexer.hook_scores / hook_selected); click a row to show that layer above.'));
    var tbl = el('table', { 'class': 'ovl', id: 'overlay-grid' }), hd = el('tr');
    hd.appendChild(el('th', {}, ''));
    for (var b = 0; b < nb; b++) hd.appendChild(el('th', { 'class': 'col' + (b === needle ? ' needle' : '') }, b === needle ? '\u25bc' : (b % 8 === 0 ? String(b) : '')));
    tbl.appendChild(hd);
    var kept = 0;
    lays.forEach(function (lay) {
      var tr = el('tr', { 'data-layer': lay.layer, 'class': lay.layer === S.layer ? 'cur' : '' });
      tr.appendChild(el('th', {}, 'L' + lay.layer));
      for (var b = 0; b < lay.indexer_selected.length; b++) {
        var st = blockState(r, lay, b);
        if (b === needle && st !== 'dropped') kept++;
        var td = el('td', { 'class': st + (b === needle ? ' needle' : ''), 'data-layer': lay.layer, 'data-block': b });
        (function (lay, b) {
          td.addEventListener('mousemove', function (ev) { tip(ev, blockText(r, lay, b)); });
          td.addEventListener('mouseleave', untip);
          td.addEventListener('click', function () { S.layer = lay.layer; S.entry = null; render(); });
        })(lay, b);
        tr.appendChild(td);
      }
      tbl.appendChild(tr);
    });
    host.appendChild(tbl);
    host.appendChild(el('p', { id: 'overlay-summary', 'data-kept': kept, 'data-layers': lays.length }, 'The needle\'s ' + word + ' ' + needle + ' is read by ' + kept + ' of ' + lays.length + ' layers at the read position' +
      (kind === 'evict' ? ' (kept, or inside the observation window).' : ' (selected, or inside the raw window).')));
  }
  function entryText(lay, e, state, wt, q) {
    var t = 'entry e' + e[0] + ' pools tokens ' + Math.max(0, e[1]) + '..' + e[2] + ' (' + state + ')';
    if (wt) t += ', attention ' + fmt(wt);
    var sc = (lay.indexer_score || []).filter(function (s) { return s[0] === e[0]; })[0];
    if (sc) { var rk = indexerRank(lay, e[0], q); t += ', indexer score ' + fmt(sc[1]) + (rk && state !== 'masked' ? ' rank ' + rk[0] + '/' + rk[1] : ''); }
    return t;
  }
  function entryDetail(lay, w, q, key) {
    var host = $('entry-detail'), e = (lay.entry_span || []).filter(function (x) { return x[0] === w; })[0];
    if (!e) return;
    host.appendChild(el('b', {}, 'Entry e' + w + ': ' + entryText(lay, e, entryState(lay, e, q), weights(lay, S.head)[0][w], q)));
    var gates = (lay.key_gate || []).filter(function (g) { return g[1] === w; });
    if (!gates.length) { host.appendChild(el('p', { 'class': 'help' }, 'No compressor gates captured for this layer (uniform pooling, or no compressor).')); return; }
    var kvs = []; gates.forEach(function (g) { if (kvs.indexOf(g[0]) < 0) kvs.push(g[0]); });
    kvs.forEach(function (kv) {
      var gs = gates.filter(function (g) { return g[0] === kv; }).sort(function (a, b) { return a[2] - b[2]; });
      var box = el('div', { 'class': 'bars gate-bars', 'data-entry': w });
      box.appendChild(el('div', { 'class': 'help' }, 'key gate weights per offset, KV head ' + kv + ' (offset o pools token ' + Math.max(0, e[1]) + ' + o; red = the needle key)'));
      gs.forEach(function (g) {
        var pos = e[1] + g[2], isK = pos === key;
        var r = el('div', { 'class': 'barrow' }); r.appendChild(el('span', { 'class': 'lab' }, 'offset ' + g[2]));
        var tr = el('span', { 'class': 'track' }), f = el('span', { 'class': 'fill' });
        f.style.cssText = 'left:0;width:' + (100 * Math.max(0, Math.min(1, g[3] || 0))) + '%;background:' + (isK ? '#c0392b' : '#7d8aa5');
        tr.appendChild(f); r.appendChild(tr); r.appendChild(el('span', { 'class': 'num' }, fmt(g[3])));
        box.appendChild(r);
      });
      host.appendChild(box);
    });
  }

  // ---------- phase shift ----------
  // Per rendering: the answer probability, the key gate weight of the needle's entry at the
  // needle's offset (selected layer, max over KV heads), and the head with the most
  // attention on the needle's value slots (raw slot + entries holding it), over layers.
  function shiftStats(r) {
    var key = mark(r, 'key_pos'), val = mark(r, 'value_pos'), lay = layerOf(r, S.layer) || r.layers[0];
    var gate = null;
    entriesHolding(lay, key).forEach(function (e) {
      (lay.key_gate || []).forEach(function (g) { if (g[1] === e[0] && e[1] + g[2] === key) gate = gate === null ? g[3] : Math.max(gate, g[3]); });
    });
    var best = null;
    r.layers.forEach(function (L) {
      var nE = (L.entry_span || []).length, slots = entriesHolding(L, val).map(function (e) { return e[0]; });
      if (L.raw_slots > val) slots.push(nE + val);
      var mass = {};
      (L.pattern || []).forEach(function (p) { if (slots.indexOf(p[1]) >= 0) mass[p[0]] = (mass[p[0]] || 0) + p[2]; });
      Object.keys(mass).forEach(function (h) { if (best === null || mass[h] > best[2]) best = [L.layer, Number(h), mass[h]]; });
    });
    var ol = overlayLayers(r), kept = null;
    if (ol.length) {
      var np = mark(r, 'phase_pos');
      kept = ol.filter(function (L) { return blockState(r, L, blockOf(np, stride(L), gridOff(L))) !== 'dropped'; }).length / ol.length;
    }
    return { prob: r.marks.answer_prob[0], gate: gate, head: best, kept: kept };
  }
  function shift() {
    if (!D.exemplars || !D.exemplars.length) return;
    $('shift-panel').hidden = false;
    var ex = exemplarsOf(S.ex), sl = $('shift-slider');
    sl.max = String(ex.length - 1); sl.value = String(Math.min(S.shift, ex.length - 1));
    var r = current(), st = shiftStats(r);
    $('shift-readout').textContent = '+' + (r.shift - ex[0].shift) + ' pads: needle phase ' + r.phase + ', P(answer) = ' + fmt(st.prob) +
      (st.kept !== null ? ', its block read by ' + fmt(st.kept) + ' of the overlay\'s layers' : ', gate weight of its entry (layer ' + S.layer + ') = ' + fmt(st.gate)) +
      ', carried by ' + (st.head ? 'L' + st.head[0] + '.H' + st.head[1] + ' (mass ' + fmt(st.head[2]) + ')' : 'no head');
    var host = $('shift-chart'); host.textContent = '';
    var pts = function (f) {
      return ex.map(function (x) { var s = shiftStats(x); return [x.phase, f(s), null, null, 1]; }).sort(function (a, b) { return a[0] - b[0]; });
    };
    var second = st.kept !== null ? { metric: 'kept', label: 'needle block read (fraction of layers)', points: pts(function (s) { return s.kept; }) }
      : { metric: 'gate', label: 'needle gate (L' + S.layer + ')', points: pts(function (s) { return s.gate; }) };
    lineChart(host, [{ metric: 'p_answer', label: 'P(answer)', points: pts(function (s) { return s.prob; }) }, second], { y0: 0, y1: 1, xlabel: 'needle phase (shift)' });
  }

  function render() {
    untip();
    accuracy(); maps(); interventions(); prompt(); shift();
  }

  // ---------- self-test (index.html#selftest): real DOM events, results in #selftest-result ----------
  function fire(node, type) {
    var r = node.getBoundingClientRect();
    node.dispatchEvent(new MouseEvent(type, { bubbles: true, clientX: r.left + 2, clientY: r.top + 2 }));
  }
  // The overlay grid against the exemplar data: a row per layer, every cell's state
  // from hook_selected, the needle column, hover and click.
  function overlayChecks(check, res) {
    var r = current(), lays = overlayLayers(r);
    if (!lays.length) return;
    var rows = document.querySelectorAll('#overlay-grid tr[data-layer]');
    check('the overlay grid has one row per layer', rows.length === lays.length, rows.length + ' of ' + lays.length);
    var bad = 0, cells = 0;
    lays.forEach(function (lay) {
      var kept = keptSet(lay);
      document.querySelectorAll('#overlay-grid td[data-layer="' + lay.layer + '"]').forEach(function (td) {
        var b = Number(td.getAttribute('data-block')), st = blockState(r, lay, b); cells++;
        if (!td.classList.contains(st) || (st === 'kept') !== !!kept[b]) bad++;
      });
    });
    check('every overlay cell shows hook_selected', cells > 0 && bad === 0, bad + ' of ' + cells + ' wrong');
    check('the needle column is marked in every row', document.querySelectorAll('#overlay-grid td.needle').length === lays.length);
    var s = $('overlay-summary');
    res.overlay = { layers: lays.length, blocks: cells / lays.length, needle_kept: s ? Number(s.getAttribute('data-kept')) : null, dropped_tokens: document.querySelectorAll('#token-strip .tok.dropped').length };
    var last = lays[lays.length - 1], td = document.querySelector('#overlay-grid td.needle[data-layer="' + last.layer + '"]');
    fire(td, 'mousemove');
    check('hovering an overlay cell names its block and state', !$('tooltip').hidden && $('tooltip').textContent.indexOf('layer ' + last.layer + ', ') === 0, $('tooltip').textContent);
    fire(td, 'click');
    check('clicking an overlay row shows that layer', $('layer-select').value === String(last.layer), $('layer-select').value);
  }
  function selftest() {
    var res = { ok: true, checks: [], cells: [], errors: [], render_ms: Math.round(window.__phaselensRenderMs || -1) };
    var check = function (name, ok, detail) { res.checks.push({ name: name, ok: !!ok, detail: detail === undefined ? '' : String(detail) }); if (!ok) res.ok = false; };
    try {
      document.querySelectorAll('td.cell[data-map]').forEach(function (td) {
        var m = D.maps[Number(td.getAttribute('data-map'))];
        res.cells.push([m.metric, m.head_kind, Number(td.getAttribute('data-layer')), Number(td.getAttribute('data-head')), Number(td.getAttribute('data-phase')), td.hasAttribute('data-value') ? td.getAttribute('data-value') : null]);
      });
      (D.maps || []).forEach(function (m, i) {
        var n = document.querySelectorAll('td.cell[data-map="' + i + '"]').length;
        check('map ' + mapName(m) + ' has one cell per head x phase', n === m.layers.length * m.heads.length * m.phases.length, n);
      });
      if (D.view === 'grid') {
        var gc = document.querySelector('td.cell[data-design]');
        check('grid has design x phase cells', !!gc, document.querySelectorAll('td.cell[data-design]').length);
        if (gc) { fire(gc, 'click'); check('clicking a design draws its accuracy by phase', document.querySelectorAll('#grid-design .phase-pt').length > 0); }
        if (D.frontier && D.frontier.length) {
          var fr = document.querySelectorAll('#frontier tr.frontier-row');
          var fd = []; D.frontier.forEach(function (x) { if (fd.indexOf(x[0]) < 0) fd.push(x[0]); });
          check('the frontier has one row per pooled design', fr.length === fd.length, fr.length + ' of ' + fd.length);
          res.frontier = [];
          fr.forEach(function (tr) {
            tr.querySelectorAll('td.verdict').forEach(function (v) { res.frontier.push([tr.getAttribute('data-design'), v.getAttribute('data-protocol'), v.textContent]); });
          });
          if (fr.length) {
            var f0 = D.frontier.filter(function (x) { return x[0] === fr[0].getAttribute('data-design'); })[0];
            fire(fr[0], 'click');
            var lines = document.querySelectorAll('#grid-design .phase-pt').length;
            check('clicking a pooled design draws each seed\'s accuracy by phase', lines > 0 && document.querySelector('#grid-design h3').textContent.indexOf(f0[0] + ' (') === 0, lines);
          }
        }
      }
      var cell = null;
      document.querySelectorAll('td.cell[data-value]').forEach(function (td) { if (!cell && td.getAttribute('data-value') !== 'NaN') cell = td; });
      if (D.maps && D.maps.length) {
        check('a map cell with a value exists', !!cell);
        if (cell) {
          var m = D.maps[Number(cell.getAttribute('data-map'))], l = Number(cell.getAttribute('data-layer')), h = Number(cell.getAttribute('data-head')), p = Number(cell.getAttribute('data-phase'));
          var want = cellText(m, cellIndex(m)[l + '.' + h + '.' + p]);
          fire(cell, 'mousemove');
          check('hover shows the value, CI and n', !$('tooltip').hidden && $('tooltip').textContent === want, $('tooltip').textContent);
          fire(cell, 'click');
          var locked = document.querySelector('td.cell.locked');
          check('click locks the cell', locked && locked.getAttribute('data-layer') === String(l) && locked.getAttribute('data-phase') === String(p));
          if (D.exemplars && D.exemplars.length) {
            check('click opens the prompt view at the cell phase', document.querySelectorAll('#token-strip .tok').length > 0 && current().phase === p, current().phase);
            check('prompt view shows the locked layer', $('layer-select').value === String(l), $('layer-select').value);
          }
        }
      } else if (D.view !== 'grid') {
        check('an experiment without per-head metrics says so', !!$('no-maps'));
      }
      if (D.exemplars && D.exemplars.length) {
        var sl = $('shift-slider'), ex = exemplarsOf(S.ex);
        var before = [current().phase, $('shift-readout').textContent];
        var target = (Number(sl.value) + 3) % ex.length;
        sl.value = String(target); sl.dispatchEvent(new Event('input', { bubbles: true }));
        var r = current(), st = shiftStats(r);
        check('slider moves the needle to another phase', r.phase === ex[target].phase && (ex.length < 2 || r.phase !== before[0]), before[0] + ' -> ' + r.phase);
        check('slider shows that rendering\'s answer probability', $('shift-readout').textContent.indexOf('P(answer) = ' + fmt(st.prob)) >= 0, $('shift-readout').textContent);
        check('the key token is marked in the strip', document.querySelectorAll('#token-strip .tok.key').length === 1);
        overlayChecks(check, res);
        var ent = document.querySelector('#entries .entry.needle') || document.querySelector('#entries .entry');
        if (ent) { fire(ent, 'click'); check('clicking an entry shows its gate weights or says there are none', $('entry-detail').textContent.length > 0); }
      } else if (D.view !== 'grid') {
        check('a missing exemplar table is stated', !!$('no-exemplars'));
      }
      var pt = document.querySelector('#accuracy .phase-pt');
      if (pt) { fire(pt, 'click'); check('clicking an accuracy point selects its phase', S.phase === Number(pt.getAttribute('data-phase'))); }
    } catch (e) { res.ok = false; res.errors.push('selftest threw: ' + e.message); }
    res.errors = res.errors.concat(window.__phaselensErrors || []);
    if (res.errors.length) res.ok = false;
    var out = $('selftest-result');
    out.textContent = JSON.stringify(res); out.hidden = false;
    document.title = res.ok ? 'SELFTEST PASS' : 'SELFTEST FAIL';
  }

  function start() {
    if (!D) { document.body.insertBefore(el('div', { 'class': 'error' }, 'data.js is missing or broken: rerun `phaselens view`.'), document.body.firstChild); return; }
    header(); mapControls(); promptControls(); other();
    if (D.view === 'grid') ['map-section', 'interventions-section', 'prompt-section'].forEach(function (id) { $(id).hidden = true; });
    var worst = D.scalars && D.scalars.worst_phase ? D.scalars.worst_phase[0] : null;
    S.phase = worst;
    if (D.maps && D.maps.length) {
      var pref = D.maps.findIndex(function (m) { return /^(nld_denoise|rel_change_pct|retrieval_score)/.test(m.metric); });
      S.map = pref >= 0 ? pref : 0;
    }
    if (worst !== null) { var ex = exemplarsOf(0); for (var i = 0; i < ex.length; i++) if (ex[i].phase === worst) S.shift = i; }
    render();
    // Time to first render, from the start of navigation (reported by the browser test).
    window.__phaselensRenderMs = performance.now();
    if (location.hash === '#selftest') selftest();
    if (location.hash === '#demo') demo();
  }
  // index.html#demo (the README's screenshots): the three clicks from the worst phase to
  // the strongest head there, its prompt and the needle's compressed entry.
  function demo() {
    var m = (D.maps || [])[S.map];
    if (!m || S.phase === null) return;
    var idx = cellIndex(m), best = null;
    m.layers.forEach(function (l) { m.heads.forEach(function (h) {
      var c = idx[l + '.' + h + '.' + S.phase];
      if (c && c[3] !== null && (best === null || Math.abs(c[3]) > Math.abs(best[3]))) best = c;
    }); });
    if (best) lockCell(S.map, best[0], best[1], S.phase);
  }
  start();
})();
