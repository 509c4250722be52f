"use strict";
// The live dashboard (aiopipe/runtime/dashboard.py): draws the server's "state", "epochs"
// and "timeline" events as they arrive on ./events. No library: DOM and SVG only.
(function () {
  const LEGEND = /*LEGEND*/null;
  const SVG = "http://www.w3.org/2000/svg";
  const RESOURCES = ["device", "uplink", "server", "downlink"];
  const root = document.getElementById("dashboard");
  let epochs = [];
  let updates = 0;

  window.addEventListener("error", (e) => report(e.message));
  window.addEventListener("unhandledrejection", (e) => report(String(e.reason)));

  function report(message) {
    document.getElementById("errors").textContent += message + "\n";
  }

  function el(tag, attrs, text) {
    const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4))
      : document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function fixed(value, digits) {
    return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
  }

  function shown(value) {
    if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toPrecision(3);
    if (typeof value === "string") return value;
    if (Array.isArray(value) && !value.length) return "[]";
    if (Array.isArray(value) && value.every((v) => typeof v !== "object")) return value.join(",");
    const text = JSON.stringify(value);
    return text.length > 60 ? text.slice(0, 59) + "…" : text;
  }

  function pairs(object) {
    return Object.entries(object || {}).map(([k, v]) => k + "=" + shown(v)).join(" ");
  }

  function touched() {
    updates += 1;
    root.dataset.updates = String(updates);
  }

  // -- state: the run, the devices, busy fractions of the epoch under way ---------------

  function drawState(state) {
    const run = document.getElementById("run");
    const phase = state.finished ? "finished" : state.epoch > 0 ? "training" : "waiting for devices";
    const privacy = state.privacy ? ` · ε ${shown(state.privacy.epsilon)}` : "";
    run.textContent = `mode ${state.mode} · ${state.devices} devices · epoch ${state.epoch} of ` +
      `${state.epochs} · round ${state.round}${privacy} · ${phase}`;
    const body = document.getElementById("devices");
    body.replaceChildren(...state.device_states.map((d) => {
      const row = el("tr", {"data-device": d.device, "data-state": d.state});
      row.append(el("td", {}, String(d.device)));
      const cell = el("td");
      cell.append(el("span", {class: "pill " + d.state, title: d.excluded}, d.state));
      row.append(cell, el("td", {}, pairs(d.plan) || "–"),
        el("td", {}, pairs(d.profile) || "–"));
      return row;
    }));
    root.dataset.devices = state.device_states.map((d) => d.device + ":" + d.state).join(",");
    const perDevice = state.device_states.some((d) => Object.keys(d.plan).length);
    document.getElementById("plan-note").textContent = !state.plan.length ? "no plan yet" :
      perDevice ? "" : "plan: " + state.plan.map(pairs).join("; ");
    const changes = (state.replans || []).slice(-5).reverse();
    document.getElementById("changes").replaceChildren(...changes.map((c) => el("li", {}, pairs(c))));
    document.getElementById("changes-note").textContent = changes.length ?
      `the latest ${changes.length} of ${state.replans.length}, newest first` : "none yet";
    drawBusy(state.busy_fraction);
  }

  function drawBusy(live) {
    const svg = document.getElementById("busy");
    const last = epochs.length ? epochs[epochs.length - 1] : null;
    const rows = RESOURCES.filter((r) => (live && r in live) || (last && last.busy_s && r in last.busy_s));
    svg.replaceChildren();
    const left = 80, width = 400, height = 13;
    svg.append(el("svg:text", {x: left, y: 12}, "epoch under way"),
      el("svg:text", {x: left + width / 2, y: 12}, last ? `epoch ${last.epoch}` : ""));
    rows.forEach((resource, i) => {
      const y = 24 + i * 30;
      svg.append(el("svg:text", {x: 0, y: y + 11}, resource));
      const fraction = live && resource in live ? live[resource] : null;
      bar(svg, left, y, width / 2 - 10, height, fraction);
      let done = null;
      if (last && last.busy_s && resource in last.busy_s) {
        const busy = last.busy_s[resource], idle = (last.idle_s || {})[resource] || 0;
        done = busy + idle > 0 ? busy / (busy + idle) : null;
      }
      bar(svg, left + width / 2, y, width / 2 - 10, height, done);
    });
    document.getElementById("busy-note").textContent = "busy (dark) and idle (light) as " +
      "fractions of the epoch; device figures are means over devices, known once a device " +
      "reports its round";
  }

  function bar(svg, x, y, width, height, fraction) {
    const track = width - 42;  // and the percentage after it
    svg.append(el("svg:rect", {x, y, width: track, height, fill: "#dde3e8"}));
    if (fraction === null || fraction === undefined) return;
    svg.append(el("svg:rect", {x, y, width: Math.max(0, Math.min(1, fraction)) * track, height,
                               fill: "#37474f", class: "busy"}));
    svg.append(el("svg:text", {x: x + width, y: y + 11, "text-anchor": "end"},
                  Math.round(fraction * 100) + "%"));
  }

  // -- epochs: chart and table -------------------------------------------------------

  function drawEpochs() {
    root.dataset.epochs = String(epochs.length);
    document.getElementById("epochs").replaceChildren(...epochs.slice(-12).reverse().map((e) => {
      const row = el("tr");
      row.append(el("td", {}, String(e.epoch)), el("td", {}, fixed(e.time_s, 2)),
        el("td", {}, fixed(e.loss, 4)), el("td", {}, fixed(e.accuracy, 3)),
        el("td", {}, String(e.samples)), el("td", {}, (e.devices_lost || []).join(" ") || "–"));
      return row;
    }));
    drawChart();
  }

  function drawChart() {
    const svg = document.getElementById("chart");
    svg.replaceChildren();
    const x0 = 44, x1 = 436, y0 = 200, y1 = 12;
    const losses = epochs.map((e) => e.loss).filter((v) => v !== null);
    const top = niceCeiling(losses.length ? Math.max(...losses) : 1);
    const n = Math.max(2, epochs.length);
    const x = (i) => x0 + (x1 - x0) * (epochs.length < 2 ? 0.5 : i / (n - 1));
    svg.append(el("svg:line", {x1: x0, y1: y0, x2: x1, y2: y0, stroke: "#999"}),
      el("svg:line", {x1: x0, y1: y0, x2: x0, y2: y1, stroke: "#999"}),
      el("svg:line", {x1: x1, y1: y0, x2: x1, y2: y1, stroke: "#999"}));
    for (let t = 0; t <= 4; t++) {
      const y = y0 - (y0 - y1) * t / 4;
      svg.append(el("svg:line", {x1: x0, y1: y, x2: x1, y2: y, stroke: "#eee"}),
        el("svg:text", {x: x0 - 4, y: y + 4, "text-anchor": "end"}, String(+(top * t / 4).toFixed(3))),
        el("svg:text", {x: x1 + 4, y: y + 4}, (t / 4).toFixed(2)));
    }
    svg.append(el("svg:text", {x: (x0 + x1) / 2, y: 224, "text-anchor": "middle"}, "epoch"));
    const series = [["loss", "#C44E52", (v) => y0 - (y0 - y1) * v / top],
                    ["accuracy", "#4C72B0", (v) => y0 - (y0 - y1) * v],
                    ["train_accuracy", "#55A868", (v) => y0 - (y0 - y1) * v]];
    const legend = document.getElementById("chart-legend");
    legend.replaceChildren();
    for (const [name, colour, y] of series) {
      const points = epochs.map((e, i) => [i, e[name]]).filter(([, v]) => v !== null && v !== undefined);
      if (!points.length) continue;
      svg.append(el("svg:polyline", {fill: "none", stroke: colour, "stroke-width": 2,
        points: points.map(([i, v]) => `${x(i)},${y(v)}`).join(" "), "data-series": name}));
      for (const [i, v] of points) {
        svg.append(el("svg:circle", {cx: x(i), cy: y(v), r: 3, fill: colour}));
      }
      const item = el("span");
      item.append(el("i", {style: "background:" + colour}),
        document.createTextNode(name.replace("_", " ") + (name === "loss" ? " (left)" : " (right)")));
      legend.append(item);
    }
    epochs.forEach((e, i) => {
      if (epochs.length <= 12 || i % Math.ceil(epochs.length / 12) === 0) {
        svg.append(el("svg:text", {x: x(i), y: y0 + 14, "text-anchor": "middle"}, String(e.epoch)));
      }
    });
  }

  function niceCeiling(value) {
    // the least of 1, 1.2, 1.6, 2, 2.4, 3.2, 4, 6, 8 (× a power of ten) not below value:
    // a quarter of each is short
    if (!(value > 0)) return 1;
    const scale = Math.pow(10, Math.floor(Math.log10(value)));
    const step = [1, 1.2, 1.6, 2, 2.4, 3.2, 4, 6, 8, 10].find((m) => m * scale >= value * 1.02);
    return (step || 10) * scale;
  }

  // -- timeline: one iteration, rows × milliseconds, coloured by slice kind -------------

  function drawTimeline(view) {
    const svg = document.getElementById("timeline");
    const label = 150, width = 1000 - label - 10, rowHeight = 20;
    const height = 30 + view.rows.length * rowHeight;
    svg.setAttribute("viewBox", `0 0 1000 ${height}`);
    svg.replaceChildren();
    document.getElementById("timeline-caption").textContent = "(" + view.caption + ")";
    const span = view.span_ms || 1;
    const x = (ms) => label + width * ms / span;
    view.rows.forEach((name, i) => {
      svg.append(el("svg:text", {x: label - 6, y: i * rowHeight + 14, "text-anchor": "end"}, name),
        el("svg:line", {x1: label, y1: (i + 1) * rowHeight - 1, x2: label + width,
                        y2: (i + 1) * rowHeight - 1, stroke: "#f0f0f0"}));
    });
    const kinds = new Set();
    for (const [row, kind, name, start, duration] of view.bars) {
      kinds.add(kind);
      const rect = el("svg:rect", {x: x(start), y: row * rowHeight + 2,
        width: Math.max(0.5, x(start + duration) - x(start)), height: rowHeight - 5,
        fill: LEGEND.colors[kind] || LEGEND.other, "data-kind": kind});
      rect.append(el("svg:title", {}, `${name}: ${start.toFixed(2)}–${(start + duration).toFixed(2)} ms`));
      svg.append(rect);
      if (x(start + duration) - x(start) > 8 * name.length) {
        svg.append(el("svg:text", {x: x(start + duration / 2), y: row * rowHeight + 13,
          "text-anchor": "middle", fill: "#fff", style: "fill:#fff"}, name));
      }
    }
    const axisY = view.rows.length * rowHeight + 14;
    for (let t = 0; t <= 5; t++) {
      svg.append(el("svg:text", {x: x(span * t / 5), y: axisY,
                                 "text-anchor": t === 5 ? "end" : t === 0 ? "start" : "middle"},
        (span * t / 5).toFixed(1) + (t === 5 ? " ms" : "")));
    }
    const legend = document.getElementById("timeline-legend");
    // timeline.png's order: the known kinds, then a system's own
    const known = Object.keys(LEGEND.names).filter((k) => kinds.has(k));
    const own = [...kinds].filter((k) => !(k in LEGEND.names)).sort();
    legend.replaceChildren(...known.concat(own).map((k) => {
      const item = el("span");
      item.append(el("i", {style: "background:" + (LEGEND.colors[k] || LEGEND.other)}),
        document.createTextNode(LEGEND.names[k] || k));
      return item;
    }));
  }

  // -- the event stream --------------------------------------------------------------

  let lastState = null;
  const live = document.getElementById("live");
  const source = new EventSource("events");
  let opens = 0;
  let away = null;  // the timer that says "reconnecting" if a reopening takes long
  source.addEventListener("open", () => {
    clearTimeout(away);
    live.textContent = "live";
    live.classList.add("on");
    opens += 1;
    root.dataset.opens = String(opens);
  });
  // a stream ends every few seconds (the server's connection rules) and reopens by itself
  // within a second: only a longer silence is news
  source.addEventListener("error", () => {
    clearTimeout(away);
    away = setTimeout(() => {
      live.textContent = source.readyState === EventSource.CLOSED ? "disconnected" : "reconnecting";
      live.classList.remove("on");
    }, 3000);
  });
  source.addEventListener("state", (event) => {
    lastState = JSON.parse(event.data);
    drawState(lastState);
    touched();
  });
  source.addEventListener("epochs", (event) => {
    const news = JSON.parse(event.data);
    epochs = epochs.slice(0, news.from).concat(news.epochs);
    drawEpochs();
    if (lastState) drawBusy(lastState.busy_fraction);
    touched();
  });
  source.addEventListener("timeline", (event) => {
    drawTimeline(JSON.parse(event.data));
    touched();
  });
})();
