// asyncrl report: draws the curves in #report-data with plotly.js (inlined before this script).
// One colour per run (data.runs[i].colour) in every chart; the smoothed curve (debiased EMA, as
// asyncrl/report/curves.py computes it) over the raw one drawn faint; x is the step or the wall time;
// a run's checkbox shows or hides it in every chart. The first screen's charts are drawn at once, the
// others as they scroll into view; window.asyncrlReport.firstScreen resolves when the first screen is
// drawn, drawAll() draws them all (tests, printing) and resolves when they are drawn.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const DASH = ["solid", "dash", "dot", "dashdot"];
  const state = { smoothing: data.smoothing, axis: "step", hidden: new Set() };
  const drawn = new Map(); // chart div -> the promise of its last draw

  function ema(ys, w) {
    let acc = 0;
    return ys.map((y, i) => {
      acc = w * acc + (1 - w) * y;
      return w ? acc / (1 - Math.pow(w, i + 1)) : y;
    });
  }

  function chartOf(div) {
    return data.plots[+div.dataset.plot].charts[+div.dataset.chart];
  }

  function x(s) {
    const axis = data.axes[s.axis];
    return state.axis === "wall" ? axis.t.map((t) => t / 60) : axis.x;
  }

  function traces(chart) {
    const out = [];
    const series = chart.series.filter((s) => state.axis === "step" || data.axes[s.axis].t);
    const weight = chart.smooth ? state.smoothing : 0; // eval points are means already: never smoothed
    for (const s of series) {
      const run = data.runs[s.run];
      const common = { x: x(s), mode: "lines", legendgroup: String(s.run), visible: !state.hidden.has(s.run) };
      const name = chart.keys.length > 1 ? run.label + " · " + s.key : run.label;
      if (weight > 0) {
        out.push({ ...common, y: s.y, line: { color: run.colour, width: 1 }, opacity: 0.25, hoverinfo: "skip", name: name + " (raw)" });
      }
      const dash = DASH[s.dash % DASH.length];
      const markers = s.y.length < 30 ? "lines+markers" : "lines";
      out.push({ ...common, y: ema(s.y, weight), mode: markers, name, line: { color: run.colour, width: 2, dash }, marker: { size: 4 } });
    }
    return out;
  }

  function layout(chart) {
    const axis = state.axis === "wall" ? "wall time (min)" : "step";
    return {
      title: chart.title ? { text: chart.title, font: { size: 12 }, x: 0.01, xanchor: "left" } : undefined,
      margin: { l: 55, r: 10, t: chart.title ? 28 : 8, b: 40 },
      xaxis: { title: { text: axis }, zeroline: false },
      yaxis: { zeroline: false },
      showlegend: false,
      hovermode: "x unified",
      uirevision: state.axis,
    };
  }

  const CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["select2d", "lasso2d"] };

  function draw(div) {
    const chart = chartOf(div);
    const done = Plotly.react(div, traces(chart), layout(chart), CONFIG);
    drawn.set(div, done);
    return done;
  }

  function redraw() {
    return Promise.all(Array.from(drawn.keys(), draw)).then(() => true);
  }

  const charts = Array.from(document.querySelectorAll("div.chart"));
  const seen = (div) => div.getBoundingClientRect().top < window.innerHeight;
  const firstScreen = Promise.all(charts.filter(seen).map(draw)).then(() => true); // not waiting to be observed
  const observer = new IntersectionObserver(
    (entries) => {
      for (const e of entries) {
        if (e.isIntersecting && !drawn.has(e.target)) draw(e.target);
      }
    },
    { rootMargin: "800px 0px" },
  );
  charts.forEach((div) => observer.observe(div));

  const slider = document.getElementById("smoothing");
  slider.addEventListener("input", () => {
    state.smoothing = +slider.value;
    document.getElementById("smoothing-value").textContent = slider.value;
    redraw();
  });
  const axis = document.getElementById("axis");
  axis.addEventListener("change", () => {
    state.axis = axis.value;
    redraw();
  });
  document.querySelectorAll("input[data-run]").forEach((box) =>
    box.addEventListener("change", () => {
      const run = +box.dataset.run;
      box.checked ? state.hidden.delete(run) : state.hidden.add(run);
      redraw();
    }),
  );

  window.asyncrlReport = {
    data,
    state,
    firstScreen,
    drawAll: () => Promise.all(charts.map((div) => drawn.get(div) || draw(div))).then(() => true),
    redraw,
  };
})();
