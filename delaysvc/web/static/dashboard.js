// delaysvc dashboard: keeps the page live without reloading it, and draws the charts.
// Every data-refresh-ms a page is refreshed in one of two ways:
// - <body data-poll="URL">: from that JSON. Table rows are matched by data-key, their
//   [data-field] elements get the row's `cells`, their [data-flag] elements are shown when the
//   row's flag is true ("!flag" negates). Rows that appear are cloned from the table's
//   <template>; rows that vanish are removed. A <ul data-list="NAME"> gets one <li> per string
//   of the JSON's NAME, and is hidden while there is none.
// - <body data-refresh-html>: the page's own URL is fetched again and each [data-live] region
//   (by id) is replaced by its new version, keeping the boxes the user has ticked; a region
//   the user is typing in is left alone until the next refresh.
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777",
    "#65a30d", "#9333ea", "#ea580c", "#0d9488", "#4f46e5", "#b91c1c", "#15803d", "#a16207",
    "#1d4ed8", "#be185d", "#047857", "#6d28d9"];

  // ------------------------------------------------------------ rows

  function applyFields(root, cells, flags) {
    root.querySelectorAll("[data-field]").forEach(function (el) {
      const value = cells[el.dataset.field];
      if (value !== undefined && el.textContent !== value) el.textContent = value;
      const titleField = el.dataset.titleField;
      if (titleField && cells[titleField] !== undefined) el.title = cells[titleField];
    });
    root.querySelectorAll("[data-flag]").forEach(function (el) {
      const name = el.dataset.flag;
      const on = name.charAt(0) === "!" ? !flags[name.slice(1)] : !!flags[name];
      el.hidden = !on;
    });
  }

  function cloneRow(table, row) {
    const template = table.querySelector("template");
    if (!template) return null;
    const tr = template.content.firstElementChild.cloneNode(true);
    const fill = function (value) {
      return value.split("__KEY__").join(row.key)
        .split("__REF__").join(encodeURIComponent(row.ref));
    };
    [tr].concat(Array.from(tr.querySelectorAll("*"))).forEach(function (el) {
      Array.from(el.attributes).forEach(function (attr) {
        if (attr.value.indexOf("__") !== -1) el.setAttribute(attr.name, fill(attr.value));
      });
    });
    return tr;
  }

  function updateRows(table, rows) {
    const tbody = table.tBodies[0];
    const existing = new Map();
    tbody.querySelectorAll("tr[data-key]").forEach(function (tr) {
      existing.set(tr.dataset.key, tr);
    });
    let previous = null;
    rows.forEach(function (row) {
      let tr = existing.get(row.key);
      existing.delete(row.key);
      if (!tr) tr = cloneRow(table, row);
      if (!tr) return;
      applyFields(tr, row.cells, row.flags);
      tr.classList.toggle("stuck", !!row.flags.stuck);
      const want = previous ? previous.nextElementSibling : tbody.firstElementChild;
      if (want !== tr) tbody.insertBefore(tr, want);
      previous = tr;
    });
    existing.forEach(function (tr) { tr.remove(); });
  }

  // ------------------------------------------------------------ charts

  function el(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    Object.keys(attrs).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // A y axis of 3 to 6 round steps (1, 2 or 5 times a power of ten) covering `value`.
  function axis(value) {
    const top = Math.max(value, 1);
    const raw = top / 5;
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map(function (m) { return m * power; })
      .find(function (s) { return s >= raw; });
    const wholeStep = Math.max(1, step);
    return { step: wholeStep, max: Math.ceil(top / wholeStep) * wholeStep };
  }

  function clear(svg) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
  }

  function frame(svg, scale, left, top, width, height) {
    for (let v = 0; v <= scale.max; v += scale.step) {
      const y = top + height - (height * v) / scale.max;
      svg.appendChild(el("line", { x1: left, x2: left + width, y1: y, y2: y, class: "grid" }));
      svg.appendChild(el("text", { x: left - 6, y: y + 4, class: "tick", "text-anchor": "end" },
        v.toLocaleString("en")));
    }
  }

  // Lines over time: chart.series [{key, points: [[seconds before now, value]], last}],
  // chart.window_s wide, labelled at chart.ticks [[seconds before now, label]]. A line goes
  // straight from sample to sample, so it never shows a value no sample had; where two
  // samples are more than chart.gap_s apart it breaks (nothing was sampled in between), and
  // a sample alone between two gaps is a dot.
  function drawLines(svg, legend, chart) {
    clear(svg);
    legend.textContent = "";
    const box = { left: 56, top: 10, width: 570, height: 200 };
    const windowS = chart.window_s;
    let maxY = 0;
    chart.series.forEach(function (s) {
      s.points.forEach(function (p) { maxY = Math.max(maxY, p[1]); });
    });
    const scale = axis(maxY);
    maxY = scale.max;
    frame(svg, scale, box.left, box.top, box.width, box.height);
    chart.ticks.forEach(function (tick) {
      const x = box.left + box.width * (1 + tick[0] / windowS);
      svg.appendChild(el("text", { x: x, y: box.top + box.height + 18, class: "tick",
        "text-anchor": tick[0] === 0 ? "end" : "middle" }, tick[1]));
    });
    if (!chart.series.length) {
      svg.appendChild(el("text", { x: box.left + box.width / 2, y: box.top + box.height / 2,
        class: "empty", "text-anchor": "middle" }, chart.empty));
      return;
    }
    chart.series.forEach(function (s, index) {
      const color = COLORS[index % COLORS.length];
      const xy = s.points.map(function (p) {
        const x = box.left + box.width * (1 + p[0] / windowS);
        const y = box.top + box.height - (box.height * p[1]) / maxY;
        return [x.toFixed(1), y.toFixed(1)];
      });
      const breaks = s.points.map(function (p, i) {
        return i === 0 || p[0] - s.points[i - 1][0] > chart.gap_s;
      });
      const d = xy.map(function (p, i) { return (breaks[i] ? "M" : "L") + p.join(" "); });
      svg.appendChild(el("path", { d: d.join(" "), stroke: color, class: "series",
        "data-key": s.key }));
      xy.forEach(function (p, i) {
        if (breaks[i] && (i === xy.length - 1 || breaks[i + 1])) {
          svg.appendChild(el("circle", { cx: p[0], cy: p[1], r: 2, fill: color, class: "lone" }));
        }
      });
      const last = xy[xy.length - 1];
      svg.appendChild(el("circle", { cx: last[0], cy: last[1], r: 3, fill: color }));
      const li = document.createElement("li");
      li.dataset.key = s.key;
      const swatch = el("svg", { width: 10, height: 10, "aria-hidden": "true" });
      swatch.appendChild(el("rect", { width: 10, height: 10, fill: color }));
      li.appendChild(swatch);
      li.appendChild(document.createTextNode(" " + s.key + ": "));
      const value = document.createElement("span");
      value.className = "value";
      value.textContent = String(s.last);
      li.appendChild(value);
      legend.appendChild(li);
    });
  }

  function drawLateness(svg, summary, chart) {
    clear(svg);
    summary.textContent = chart.summary;
    const box = { left: 56, top: 16, width: 570, height: 190 };
    const scale = axis(Math.max.apply(null, chart.counts.concat([0])));
    const maxY = scale.max;
    frame(svg, scale, box.left, box.top, box.width, box.height);
    const slot = box.width / chart.counts.length;
    chart.counts.forEach(function (count, i) {
      const h = (box.height * count) / maxY;
      const x = box.left + i * slot + 3;
      svg.appendChild(el("rect", { x: x, y: box.top + box.height - h, width: slot - 6,
        height: h, class: i === chart.counts.length - 1 ? "bar over" : "bar",
        "data-bucket": chart.labels[i], "data-count": count }));
      svg.appendChild(el("text", { x: x + (slot - 6) / 2, y: box.top + box.height + 16,
        class: "tick small", "text-anchor": "middle" }, chart.labels[i]));
      if (count > 0) {
        svg.appendChild(el("text", { x: x + (slot - 6) / 2, y: box.top + box.height - h - 3,
          class: "tick small", "text-anchor": "middle" }, count.toLocaleString("en")));
      }
    });
  }

  // ------------------------------------------------------------ pages

  function renderTimeline(list, events) {
    list.textContent = "";
    events.forEach(function (event) {
      const li = document.createElement("li");
      const time = document.createElement("time");
      time.textContent = event.at;
      const label = document.createElement("strong");
      label.textContent = event.label;
      const detail = document.createElement("span");
      detail.className = "mono";
      detail.textContent = event.detail;
      li.append(time, " ", label, " ", detail);
      if (event.trace) {
        const details = document.createElement("details");
        const summaryEl = document.createElement("summary");
        summaryEl.textContent = "traceback";
        const pre = document.createElement("pre");
        pre.textContent = event.trace;
        details.append(summaryEl, pre);
        li.appendChild(details);
      }
      list.appendChild(li);
    });
  }

  function updateList(list, lines) {
    const items = Array.from(list.children).map(function (li) { return li.textContent; });
    if (items.join("\n") !== lines.join("\n")) {
      list.replaceChildren.apply(list, lines.map(function (line) {
        const li = document.createElement("li");
        li.textContent = line;
        return li;
      }));
    }
    list.hidden = lines.length === 0;
  }

  function render(data) {
    document.querySelectorAll("ul[data-list]").forEach(function (list) {
      const lines = data[list.dataset.list];
      if (lines) updateList(list, lines);
    });
    document.querySelectorAll("table[data-rows]").forEach(function (table) {
      const rows = data[table.dataset.rows];
      if (rows) updateRows(table, rows);
    });
    document.querySelectorAll("svg[data-lines]").forEach(function (svg) {
      const chart = data[svg.dataset.lines];
      if (chart) drawLines(svg, document.getElementById(svg.id + "-legend"), chart);
    });
    document.querySelectorAll("svg[data-buckets]").forEach(function (svg) {
      const chart = data[svg.dataset.buckets];
      if (chart) drawLateness(svg, document.getElementById(svg.id + "-summary"), chart);
    });
    const message = document.getElementById("message");
    if (message && data.cells) {
      applyFields(message, data.cells, data.flags);
      renderTimeline(document.getElementById("timeline"), data.timeline);
    }
    const empty = document.getElementById("no-topics");
    if (empty && data.topics) empty.hidden = data.topics.length > 0;
  }

  function swapRegions(html) {
    const fresh = new DOMParser().parseFromString(html, "text/html");
    document.querySelectorAll("[data-live][id]").forEach(function (region) {
      const next = fresh.getElementById(region.id);
      if (!next) return;
      const typing = "input:not([type=checkbox]):not([type=radio]), select, textarea";
      if (region.contains(document.activeElement) && document.activeElement.matches(typing)) {
        return;
      }
      const ticked = new Set();
      region.querySelectorAll("input[type=checkbox]:checked").forEach(function (box) {
        ticked.add(box.name + "=" + box.value);
      });
      next.querySelectorAll("input[type=checkbox]").forEach(function (box) {
        if (ticked.delete(box.name + "=" + box.value)) box.checked = true;
      });
      // a ticked row the fresh page no longer holds (newer rows pushed it off) stays, ticked,
      // at the end of its table, so an action on the selection still reaches it
      const body = next.querySelector("tbody");
      region.querySelectorAll("tbody tr").forEach(function (row) {
        const box = row.querySelector("input[type=checkbox]:checked");
        if (body && box && ticked.has(box.name + "=" + box.value)) {
          row.classList.add("kept");
          body.appendChild(row);
        }
      });
      region.replaceWith(document.adoptNode(next));
    });
    wireForms(document);
  }

  function startPolling() {
    const url = document.body.dataset.poll;
    const html = document.body.dataset.refreshHtml !== undefined;
    if (!url && !html) return;
    const every = parseInt(document.body.dataset.refreshMs || "3000", 10);
    const state = document.getElementById("refresh-state");
    let refreshes = 0;
    function tick() {
      if (document.visibilityState === "hidden") {
        setTimeout(tick, every);
        return;
      }
      const accept = html ? "text/html" : "application/json";
      fetch(html ? window.location.href : url,
        { credentials: "same-origin", headers: { Accept: accept } })
        .then(function (response) {
          const loggedOut = response.status === 401 ||
            (response.redirected && new URL(response.url).pathname === "/login");
          if (loggedOut) {
            window.location.assign("/login?next=" + encodeURIComponent(window.location.pathname));
            throw new Error("logged out");
          }
          if (!response.ok) throw new Error("HTTP " + response.status);
          return html ? response.text() : response.json();
        })
        .then(function (data) {
          if (html) swapRegions(data);
          else render(data);
          refreshes += 1;
          document.body.dataset.refreshes = String(refreshes);
          if (state) {
            state.textContent = "live, " + new Date().toLocaleTimeString("en-GB");
            state.classList.remove("error");
          }
        })
        .catch(function (error) {
          if (state) {
            state.textContent = "refresh failed (" + error.message + "); retrying";
            state.classList.add("error");
          }
        })
        .finally(function () { setTimeout(tick, every); });
    }
    setTimeout(tick, every);
  }

  function wireForms(root) {
    root.querySelectorAll("form[data-confirm]:not([data-wired])").forEach(function (form) {
      form.dataset.wired = "";
      form.addEventListener("submit", function (event) {
        if (!window.confirm(form.dataset.confirm)) event.preventDefault();
      });
    });
    root.querySelectorAll("input[data-select-all]:not([data-wired])").forEach(function (box) {
      box.dataset.wired = "";
      box.addEventListener("change", function () {
        document.querySelectorAll('input[type=checkbox][name="' + box.dataset.selectAll + '"]')
          .forEach(function (item) { item.checked = box.checked; });
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    const initial = document.getElementById("initial-data");
    if (initial) render(JSON.parse(initial.textContent));
    wireForms(document);
    startPolling();
  });
})();
