// The live run page: follow the run's feed with EventSource (ledger_client.sse: `id:` is the
// event id, so after a dropped stream the browser reconnects with Last-Event-ID and the server
// resumes after that event), add each new event to the table and redraw the timeline from the
// server. Text goes into the page with textContent, never as HTML.
"use strict";
(function () {
  const table = document.getElementById("events");
  const live = document.getElementById("live");
  if (!table || !live || live.dataset.live !== "yes") return;
  const body = table.querySelector("tbody");
  const seen = new Set(Array.from(body.querySelectorAll("tr[data-event]"), (tr) => tr.dataset.event));
  const timeline = document.getElementById("timeline");
  const source = new EventSource(table.dataset.stream);
  let redraw = null;
  let asked = 0;  // the newest drawing asked for: an older answer arriving late is dropped

  function refreshTimeline() {
    if (redraw) return;
    redraw = setTimeout(async () => {
      redraw = null;
      const mine = ++asked;
      const answer = await fetch(timeline.dataset.src, { credentials: "same-origin" });
      const svg = answer.ok ? await answer.text() : null;
      if (svg !== null && mine === asked) timeline.innerHTML = svg;  // an SVG the server escaped
    }, 200);
  }

  function onEvent(message) {
    // The stream starts at the run's first event: skip what the page already shows.
    if (seen.has(message.lastEventId)) return;
    seen.add(message.lastEventId);
    const event = JSON.parse(message.data);
    const row = document.createElement("tr");
    row.dataset.event = event.event_id;
    row.className = "new";
    const texts = [String(event.seq), event.event_type, event.created_at.replace("T", " "), JSON.stringify(event.payload)];
    for (const [i, text] of texts.entries()) {
      const cell = document.createElement("td");
      const holder = i === 3 ? cell.appendChild(document.createElement("code")) : cell;
      holder.textContent = text;
      row.appendChild(cell);
    }
    body.appendChild(row);
    refreshTimeline();
    const status = document.getElementById("run-status");
    if (event.event_type === "run.status" && status && event.payload && event.payload.to) {
      status.textContent = event.payload.to;
      status.className = "status s-" + event.payload.to;
    }
    if (event.ends_run) {
      live.textContent = "ended";
      source.close();
    }
  }

  // Each frame's SSE event name is the feed's event_type; EventSource has no catch-all listener,
  // so the page lists the types (data-types, from the server).
  for (const type of (table.dataset.types || "").split(" ")) {
    if (type) source.addEventListener(type, onEvent);
  }
  source.addEventListener("message", onEvent);
  source.onopen = () => { live.textContent = "live"; };
  source.onerror = () => {
    live.textContent = source.readyState === EventSource.CLOSED ? "ended" : "reconnecting";
  };
})();
