(function () {
  var el = document.getElementById('traj-data');
  if (!el) return;
  var data = JSON.parse(el.textContent), recs = data.records, rows = data.rows;
  var steps = [];
  recs.forEach(function (r) { if (steps.indexOf(r.step) < 0) steps.push(r.step); });
  var select = document.getElementById('traj-step'), box = document.getElementById('traj-tables');
  steps.forEach(function (s) {
    var o = document.createElement('option'); o.value = s; o.textContent = s; select.appendChild(o);
  });
  function fmt(v) {
    var a = Math.abs(v);
    if (v === 0) return '0';
    if (a >= 100) return v.toFixed(0);
    if (a >= 10) return v.toFixed(1);
    if (a < 0.005) return v.toExponential(0);
    return v.toFixed(2);
  }
  function show(tok) {
    return tok.replace(/ /g, '\u2423').replace(/\n/g, '\u23ce').replace(/\t/g, '\u21e5');
  }
  function cell(tr, v, seg, scale, isMask) {
    var td = document.createElement('td');
    td.setAttribute('data-segment', seg);
    if (v === null || v === undefined) {
      td.className = 'na'; td.textContent = '\u00b7'; td.setAttribute('data-value', ''); tr.appendChild(td); return;
    }
    td.setAttribute('data-value', String(v));
    td.title = String(v);
    td.textContent = isMask ? String(v) : fmt(v);
    var a = scale > 0 ? Math.min(1, Math.abs(v) / scale) : 0;
    if (isMask) td.style.background = v ? 'rgba(44,160,44,0.45)' : 'rgba(150,150,150,0.25)';
    else if (v > 0) td.style.background = 'rgba(33,102,172,' + (0.06 + 0.7 * a).toFixed(3) + ')';
    else if (v < 0) td.style.background = 'rgba(178,24,43,' + (0.06 + 0.7 * a).toFixed(3) + ')';
    if (a > 0.6 && !isMask) td.style.color = '#fff';
    tr.appendChild(td);
  }
  function table(r) {
    var wrap = document.createElement('div'); wrap.className = 'trajwrap';
    var h = document.createElement('h3');
    var kl = r.kl_in_loss ? 'KL is a loss term (reward = score only)'
                          : 'reward = score on the last token - ' + r.kl_coef + ' * KL';
    h.innerHTML = 'step ' + r.step + ', batch row ' + r.index + ', score <b>' + fmt(r.score) + '</b> &middot; KL estimator '
      + r.kl_estimator + ' &middot; ' + kl + '<br>';
    var p = document.createElement('code'); p.textContent = r.prompt; h.appendChild(p);
    h.appendChild(document.createTextNode(' \u2192 '));
    var c = document.createElement('code'); c.textContent = r.response; h.appendChild(c);
    wrap.appendChild(h);
    var t = document.createElement('table'); t.className = 'trajectory';
    t.setAttribute('data-step', r.step); t.setAttribute('data-index', r.index);
    var head = document.createElement('thead'), hr = document.createElement('tr');
    hr.setAttribute('data-row', 'token');
    var th0 = document.createElement('th'); th0.className = 'rowname'; th0.textContent = 'token'; hr.appendChild(th0);
    r.tokens.forEach(function (tok, i) {
      var th = document.createElement('th'); th.className = 'seg-' + r.segment[i];
      th.setAttribute('data-segment', r.segment[i]); th.textContent = show(tok); th.title = r.segment[i] + ' #' + i;
      hr.appendChild(th);
    });
    head.appendChild(hr); t.appendChild(head);
    var body = document.createElement('tbody');
    rows.forEach(function (pair) {
      var name = pair[0], vals = r.rows[name];
      if (!vals) return;
      var tr = document.createElement('tr'); tr.setAttribute('data-row', name);
      var th = document.createElement('th'); th.className = 'rowname'; th.textContent = name; th.title = pair[1];
      tr.appendChild(th);
      var scale = 0;
      vals.forEach(function (v) { if (v !== null && Math.abs(v) > scale) scale = Math.abs(v); });
      vals.forEach(function (v, i) { cell(tr, v, r.segment[i], scale, name === 'mask'); });
      body.appendChild(tr);
    });
    t.appendChild(body); wrap.appendChild(t);
    return wrap;
  }
  function render(step) {
    box.innerHTML = '';
    recs.filter(function (r) { return r.step === step; }).forEach(function (r) { box.appendChild(table(r)); });
  }
  if (/only=trajectories/.test(location.hash)) {  // the view alone, e.g. for a screenshot
    document.querySelectorAll('section, nav').forEach(function (s) {
      if (s.id !== 'trajectories') s.style.display = 'none';
    });
  }
  var initial = steps[steps.length - 1], m = /step=(\d+)/.exec(location.hash);
  if (m && steps.indexOf(+m[1]) >= 0) initial = +m[1];
  select.value = String(initial);
  select.onchange = function () { render(+select.value); };
  render(initial);
})();
